"""What the Ray backend reserves, checked against a real (local, CPU-only) Ray instance before any actor is
placed: GPUs it cannot have are named with their flag, not waited for in silence."""

from __future__ import annotations

import pytest

from orchestration.config import RayConfig, TrainConfig
from orchestration.ray_session import check_resources


@pytest.mark.parametrize("config, named", [
    (TrainConfig(env="builtin:cartpole", backend="ray", ray=RayConfig(learner_num_gpus=1)),
     "--ray.learner-num-gpus 1 asks for 1 GPU but the cluster has 0"),
    (TrainConfig(env="builtin:cartpole", backend="ray", ray=RayConfig(learner_num_gpus=0.5, learners_per_policy=2,
                                                                    learner_num_cpus=0.5)),
     "--ray.learner-num-gpus 0.5 asks for 1 GPU (2 learner processes) but the cluster has 0"),
    (TrainConfig(env="builtin:cartpole", backend="ray", device="cuda"), "--device cuda: the learners get no GPU"),
    (TrainConfig(env="builtin:cartpole", backend="ray", ray=RayConfig(learner_resources=(("learner_node", 1.0),))),
     "--ray.learner-resources learner_node 1: the learners and the statistics actor reserve 2 of Ray resource "
     "'learner_node' and the cluster has 0"),  # the run waited for ever
])
def test_gpus_the_cluster_lacks_are_refused_on_an_own_instance_and_warned_about_on_a_joined_one(ray_session, config,
                                                                                              named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_resources(config, config.ray, 1, strict=True)
    with pytest.warns(UserWarning, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_resources(config, config.ray, 1, strict=False)
    check_resources(TrainConfig(env="builtin:cartpole", backend="ray"), RayConfig(), 1, strict=True)  # auto: fits
