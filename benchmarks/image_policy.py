"""Training cost of a conv policy against a flattened-pixel MLP on the built-in image task, as one JSON object.

Both cases train PPO on ``builtin:spot`` (one 12x12 grey image per env step by default) with the same rollout
and PPO settings, in the same run; only ``PolicyConfig.image_encoder`` differs:

- ``nature``: the Nature DQN CNN (its 3x3 variant below 36 pixels) -> ``image_features`` -> the MLP trunks;
- ``flatten``: every pixel an MLP input (the reference).

Each case runs in a fresh subprocess (``spawn``), so that its peak memory is its own: after one warm-up
iteration, ``--iterations`` training iterations are timed. Reported per case (median over ``--repeats``
interleaved runs, every run listed): ``env_steps_per_s`` (env steps collected and trained on per second of
wall clock, the trainer's own ``time_iteration``), the per-iteration split into ``collect_s`` and ``learn_s``,
``peak_rss_mb`` (the process's peak resident memory, imports included), ``rss_growth_mb`` (that peak minus
the resident memory after the trainer was built: what training itself added), ``params``, and on CUDA
``cuda_peak_mb`` (``torch.cuda.max_memory_allocated``). ``nature_vs_flatten`` divides the CNN's throughput
by the reference's.

Run: ``python benchmarks/image_policy.py [--repeats 3] [--iterations 5] [--size 12] [--device cpu]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import time


def _rss_mb() -> float:
    """Current resident memory of this process in MiB (Linux ``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_case(encoder: str, args: dict) -> dict:
    """Builds a trainer with ``image_encoder=encoder``, warms up, times ``iterations`` training iterations."""
    import torch

    from core.losses import PPOConfig
    from core.policies import PolicyConfig
    from orchestration.builder import build_trainer
    from orchestration.config import RolloutConfig, TrainConfig

    torch.set_num_threads(args["threads"])
    config = TrainConfig(env="builtin:spot", seed=0, iterations=args["iterations"] + 1, device=args["device"],
                         lr=2.5e-3,
                         env_kwargs=(("size", str(args["size"])), ("channels", str(args["channels"]))),
                         policy=PolicyConfig(image_encoder=encoder, image_features=args["features"]),
                         rollout=RolloutConfig(num_envs=args["num_envs"], fragment_length=args["fragment_length"]),
                         ppo=PPOConfig(minibatch_size=args["minibatch_size"], num_epochs=args["epochs"]))
    trainer = build_trainer(config)
    policy = trainer.learners["agent"].policy
    rss_built = _rss_mb()
    trainer.train()  # warm-up: first calls, allocator growth
    cuda = torch.device(args["device"]).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = wall = collect = learn = 0.0
    for _ in range(args["iterations"]):
        start = time.perf_counter()
        m = trainer.train()
        wall += time.perf_counter() - start
        steps += config.steps_per_iteration
        collect, learn = collect + m["time_collect"], learn + m["time_learn"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out = {"env_steps_per_s": steps / wall, "collect_s": collect / args["iterations"],
           "learn_s": learn / args["iterations"], "peak_rss_mb": peak, "rss_growth_mb": peak - rss_built,
           "params": sum(p.numel() for p in policy.parameters()),
           "return_after": m["episode_return_mean"]}
    if cuda:
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    trainer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=5, help="timed training iterations per run")
    parser.add_argument("--size", type=int, default=12, help="image side (even, >= 8; 36 and up: the 8x8 Nature CNN)")
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--features", type=int, default=512, help="PolicyConfig.image_features")
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--fragment-length", type=int, default=16)
    parser.add_argument("--minibatch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="learner device: cpu, cuda or auto")
    args = vars(parser.parse_args())
    ctx = multiprocessing.get_context("spawn")
    runs: dict[str, list[dict]] = {"nature": [], "flatten": []}
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # one fresh process per run: peak memory is per case
        for _ in range(args["repeats"]):  # interleaved, so slow phases of the machine hit both cases alike
            for encoder in runs:
                runs[encoder].append(pool.apply(run_case, (encoder, args)))
    result: dict = {"env": f"builtin:spot ({args['channels']}x{args['size']}x{args['size']} uint8)",
                    "settings": {k: args[k] for k in ("iterations", "num_envs", "fragment_length", "minibatch_size",
                                                      "epochs", "features", "threads", "device", "repeats")},
                    "unit": "env-steps/s (collected and trained)"}
    for encoder, values in runs.items():
        entry = {k: round(statistics.median(v[k] for v in values), 3) for k in values[0]}
        entry["env_steps_per_s"] = round(entry["env_steps_per_s"])
        entry["params"] = int(entry["params"])
        entry["runs"] = [round(v["env_steps_per_s"]) for v in values]
        result[encoder] = entry
    result["nature_vs_flatten"] = round(result["nature"]["env_steps_per_s"] / result["flatten"]["env_steps_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
