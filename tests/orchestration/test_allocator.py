"""``orchestration.allocator``: after ``keep_freed_memory()`` a training step stops faulting its pages in anew."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a 2 x 256 MLP's forward and backward on 1,200 rows: minor page faults per step before and after tuning
_SCRIPT = """
import json, resource, torch
from orchestration.allocator import keep_freed_memory
torch.set_num_threads(1)
net = torch.nn.Sequential(torch.nn.Linear(18, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                          torch.nn.Linear(256, 2))
x = torch.randn(1200, 18)

def faults_per_step():
    for _ in range(3):
        net(x).square().mean().backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        net(x).square().mean().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

default = faults_per_step()
tuned = keep_freed_memory()
print(json.dumps({"default": default, "tuned": tuned, "after": faults_per_step(), "again": keep_freed_memory()}))
"""


def _run(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update({"SHOAL_KEEP_FREED_MEMORY": "1", **env})
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=environ, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_tuned_allocator_keeps_activation_pages():
    got = _run()
    assert got["tuned"] and got["again"]
    # glibc's defaults: each step faults some of its activations' pages in again (90-390 a step, run to run)
    assert got["default"] > 50
    assert got["after"] < got["default"] / 5


def test_opt_out_and_user_settings_leave_malloc_alone():
    assert _run(SHOAL_KEEP_FREED_MEMORY="0")["tuned"] is False
    user = _run(MALLOC_TRIM_THRESHOLD_="1000000000")
    assert user["tuned"] is False
