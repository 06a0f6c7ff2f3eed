"""Weight broadcast: from publishing a version to every rollout worker holding it, vs raw put + get.

Ours: ``to_wire`` + one ``ray.put`` of the policy's weights (what a learner does once per version), then
``RayFleet.broadcast(..., wait=True)``: each worker gets the same ref, rebuilds the TensorDict zero-copy and
copies it into its policy module. Raw, in the same run and on the same tensors: ``ray.put`` of the plain
``state_dict`` (torch tensors) and a ``ray.get`` inside as many bare actors, with no load into a module
(and, for reference, the same with the tensors as numpy arrays: the floor of any Ray transport).
Policies are CartPole actor-critics whose hidden width gives about 1M and 10M parameters; 1/2/4 workers.
Targets: ours within 1.5x of raw; one serialization (put) per version whatever the number of workers.

    python benchmarks/weight_broadcast.py [--repeats 7] [--params 1e6 1e7] [--workers 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import ray
import torch

from core.policies import PolicyConfig
from orchestration.builder import build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.ray_session import init_ray
from orchestration.wire import to_wire


@ray.remote(num_cpus=0)
class RawReceiver:
    """A bare actor that fetches what it is given (the raw baseline's receiving side)."""

    def get(self, refs: list) -> int:
        return sum(v.nbytes for v in ray.get(refs[0]).values())  # torch and numpy both have nbytes


def hidden_for(params: float) -> int:
    """Width ``h`` of two hidden layers such that actor + critic (4 -> h -> h -> 2 and -> 1) hold ~``params``."""
    return int((-17 + math.sqrt(17**2 + 8 * params)) / 4)  # 2h^2 + 17h + 3 = params


def measure(num_params: float, worker_counts: list[int], repeats: int) -> dict:
    hidden = hidden_for(num_params)
    config = TrainConfig(env="builtin:cartpole", policy=PolicyConfig(hidden_sizes=(hidden, hidden)),
                         rollout=RolloutConfig(num_envs=1, fragment_length=1, num_workers=max(worker_counts)),
                         backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0))
    trainer = build_trainer(config)
    receivers = [RawReceiver.remote() for _ in range(max(worker_counts))]
    ray.get([r.get.remote([ray.put({})]) for r in receivers])
    (pid, (version, _)), = trainer.weights.items()
    weights = trainer.learners[pid].weights()[1]  # the tensors the learner publishes
    n_params = sum(v.numel() for v in weights.values(True, True))
    state = {".".join(k): v.clone() for k, v in weights.items(True, True)}
    results, slots = {}, list(trainer.fleet.slots)
    for k in worker_counts:
        ours, raw, raw_np, puts = [], [], [], 0
        trainer.fleet.slots = slots[:k]
        for _ in range(repeats):  # interleaved
            version += 1
            start = time.perf_counter()
            ref = ray.put(to_wire(weights, {"version": version}))
            puts += 1
            trainer.fleet.broadcast({pid: (version, [ref])}, wait=True)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            raw_ref = ray.put(state)
            ray.get([r.get.remote([raw_ref]) for r in receivers[:k]])
            raw.append(time.perf_counter() - start)
            start = time.perf_counter()
            np_ref = ray.put({name: v.numpy() for name, v in state.items()})
            ray.get([r.get.remote([np_ref]) for r in receivers[:k]])
            raw_np.append(time.perf_counter() - start)
        held = ray.get([s.handle.sync_weights.remote({}) for s in slots[:k]])
        assert all(h[pid] == version for h in held), held
        results[f"{k}_workers"] = {"ours_ms": 1e3 * statistics.median(ours), "raw_ms": 1e3 * statistics.median(raw),
                                   "ratio": statistics.median(ours) / statistics.median(raw), "target": 1.5,
                                   "raw_numpy_ms": 1e3 * statistics.median(raw_np),
                                   "serializations_per_version": puts / repeats,
                                   "ours_runs_ms": [round(1e3 * t, 2) for t in ours],
                                   "raw_runs_ms": [round(1e3 * t, 2) for t in raw]}
    trainer.fleet.slots = slots
    trainer.close()
    for r in receivers:
        ray.kill(r)
    return {"params": n_params, "megabytes": n_params * 4 / 1e6, "hidden": hidden, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_ray(TrainConfig(), RayConfig())
    out = {f"{p:.0e}": measure(p, sorted(args.workers), args.repeats) for p in args.params}
    print(json.dumps({"benchmark": "weight_broadcast", "repeats": args.repeats, "sizes": out}, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
