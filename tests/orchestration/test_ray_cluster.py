"""Two Ray nodes (``ray.cluster_utils.Cluster``): workers spread over both; training survives losing one.

The cluster needs its own Ray instance, so the scenario runs in a subprocess (the session-wide instance of
the other Ray tests stays untouched) and prints one JSON line that the test checks. The subprocess gets a
private ``RAY_TMPDIR``: ``Cluster`` writes its address to ``$RAY_TMPDIR/ray/ray_current_cluster``, which
a plain ``ray.init()`` anywhere on the machine would otherwise join while the test runs (or, after a crash,
fail on).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCENARIO = textwrap.dedent("""
    import json, time
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from orchestration.builder import build_trainer
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig

    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "resources": {"head": 1}, "include_dashboard": False})
    second = cluster.add_node(num_cpus=2, resources={"second": 1})
    cluster.wait_for_nodes()
    ray_config = RayConfig(worker_num_cpus=1, learner_num_cpus=0, worker_strategy="SPREAD",
                           learner_resources=(("head", 0.5),))
    config = TrainConfig(env="builtin:cartpole", iterations=50, train_batch_size=128, address=cluster.address,
                         rollout=RolloutConfig(num_envs=4, fragment_length=16, num_workers=2), backend="ray",
                         mode="async", ray=ray_config)
    try:
        trainer = build_trainer(config)
        head_id = ray.get_runtime_context().get_node_id()
        nodes = sorted({ray.get(h.info.remote())["node_id"] for h in trainer.fleet.handles()})
        before = [trainer.train()["policy_version"] for _ in range(3)]
        cluster.remove_node(second)
        after = []
        deadline = time.time() + 120
        while (trainer.fleet.restarts < 1 or len(after) < 3) and time.time() < deadline:
            after.append(trainer.train()["policy_version"])
        alive = trainer.fleet.alive(timeout=60)
        nodes_after = sorted({ray.get(h.info.remote())["node_id"] for h in trainer.fleet.handles()})
        trainer.close()
        print(json.dumps({"nodes": nodes, "head": head_id, "before": before, "after": after, "alive": alive,
                          "nodes_after": nodes_after, "accounting": trainer.accounting()}))
    finally:
        ray.shutdown()
        cluster.shutdown()
""")


def test_two_nodes_then_one():
    temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's unix socket paths live under it
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": temp}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        result = subprocess.run([sys.executable, "-c", SCENARIO], cwd=root, env=env, capture_output=True,
                                text=True, timeout=300)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["nodes"]) == 2, out  # SPREAD put one worker on each node
    assert out["before"] == [1, 2, 3], out
    assert out["after"] and out["after"][-1] > 3, out  # training went on without the second node
    assert out["alive"] == 2, out
    assert out["nodes_after"] == [out["head"]], out  # the lost worker was re-created on the head
    acc = out["accounting"]
    assert acc["workers_restarted"] >= 1, acc
    assert acc["fragments_accepted"] + acc["fragments_stale"] + acc["fragments_lost"] == acc["fragments_produced"], acc
    assert acc["fragments_in_flight"] == 0, acc
