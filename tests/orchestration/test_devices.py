"""The ``--device`` flag: its forms checked without torch, and a device this process cannot use named."""

from __future__ import annotations

import pytest
import torch

from orchestration.config import TrainConfig
from orchestration.devices import device_problem, resolve_device


@pytest.mark.parametrize("name", ["auto", "cpu", "cpu:0", "cuda", "cuda:1", "mps"])
def test_the_documented_forms_pass(name):
    assert device_problem(name) is None


@pytest.mark.parametrize("name, nearest", [("gpu", "cuda"), ("CUDA", "cuda"), ("GPU:1", "cuda:1"), ("cuda1", "cuda"),
                                           ("CPU", "cpu"), ("tpu", "auto"), ("", "auto")])
def test_other_forms_are_refused_with_the_nearest_one(name, nearest):
    problem = device_problem(name)
    assert problem.startswith(f"--device {name!r} is not a device") and problem.endswith(f"did you mean {nearest!r}?")
    with pytest.raises(ValueError, match="is not a device"):
        TrainConfig(env="builtin:cartpole", device=name)


def test_a_cuda_device_this_process_cannot_use_is_named():
    beyond = f"cuda:{torch.cuda.device_count()}"  # one past the last, or cuda:0 on a machine without CUDA
    with pytest.raises(ValueError, match=f"--device {beyond}: .*use --device auto"):
        resolve_device(beyond)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
