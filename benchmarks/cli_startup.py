"""How long the ``shoal`` command takes outside training: ``--help``, ``train --help``, and a short run's start and end.

Each repeat runs, in fresh processes and one after the other (interleaved, so a busy machine slows all alike):

- ``shoal --help`` and ``shoal train --help`` (wall time; target: under 2 s each);
- ``shoal train`` with the README's defaults (gymnasium CartPole-v1, 16 envs x 64 steps) for a few iterations:
  its wall time less the iterations' own time (``time_iteration`` of ``metrics.csv``) is the time spent outside
  the training loop (interpreter start, imports, building the trainer, the run directory, checkpoints, the
  learning-curve PNG; target: at most 4 s);
- a bare reference script that imports torch and gymnasium and runs an equivalent tiny PPO-shaped loop (same
  envs, 64x64 actor and critic, clipped loss, 4 epochs of 4 minibatches; rewards stand in for returns): the same
  wall-less-loop figure, the floor that any torch trainer pays on this machine.

Figures are medians over the repeats (seconds). ``cpu_s`` is the process's user + system CPU time: on a busy
machine (other jobs on the same cores) wall times grow with the load, CPU times much less.

    python benchmarks/cli_startup.py                  # 5 repeats, 3 iterations
    python benchmarks/cli_startup.py --repeats 9 --iterations 5
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REFERENCE = r'''
import json, sys, time
import gymnasium as gym
import torch

torch.set_num_threads(1)
iterations, num_envs, steps = int(sys.argv[1]), 16, 64
envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs)
def mlp(out):
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, out))
actor, critic = mlp(2), mlp(1)
optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=2.5e-3, eps=1e-5)
obs, _ = envs.reset(seed=0)
start = time.perf_counter()
for _ in range(iterations):
    observations, actions, rewards, log_probs = [], [], [], []
    for _ in range(steps):
        o = torch.as_tensor(obs, dtype=torch.float32)
        with torch.no_grad():
            dist = torch.distributions.Categorical(logits=actor(o))
            a = dist.sample()
        obs, r, term, trunc, _ = envs.step(a.numpy())
        observations.append(o); actions.append(a); rewards.append(torch.as_tensor(r, dtype=torch.float32))
        log_probs.append(dist.log_prob(a))
    o, a, old = torch.cat(observations), torch.cat(actions), torch.cat(log_probs)
    returns = torch.cat(rewards)
    for _ in range(4):
        for idx in torch.randperm(len(o)).chunk(4):
            value = critic(o[idx]).squeeze(-1)
            advantage = (returns[idx] - value).detach()
            ratio = (torch.distributions.Categorical(logits=actor(o[idx])).log_prob(a[idx]) - old[idx]).exp()
            loss = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean() \
                + 0.5 * (value - returns[idx]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
print(json.dumps({"loop_s": time.perf_counter() - start}))
'''


def _shoal() -> list[str]:
    script = Path(sys.executable).parent / "shoal"  # the console script users run, next to this interpreter
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestration.cli"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(args: list[str], cwd: str) -> tuple[float, float, str]:
    """Wall and CPU seconds of a command run to its end, and its standard output."""
    cpu, start = _children_cpu(), time.perf_counter()
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return wall, cpu, result.stdout


def _train(iterations: int, work: str, k: int) -> dict[str, float]:
    run_dir = Path(work) / f"run{k}"
    wall, cpu, _ = _timed([*_shoal(), "train", "--iterations", str(iterations), "--no-progress", "--run-dir",
                           str(run_dir)], work)
    with open(run_dir / "metrics.csv") as f:
        loop = sum(float(row["time_iteration"]) for row in csv.DictReader(f))
    return {"wall_s": wall, "loop_s": loop, "outside_loop_s": wall - loop, "cpu_s": cpu}


def _reference(iterations: int, work: str) -> dict[str, float]:
    script = Path(work) / "reference.py"
    script.write_text(REFERENCE)
    wall, cpu, out = _timed([sys.executable, str(script), str(iterations)], work)
    loop = json.loads(out.strip().splitlines()[-1])["loop_s"]
    return {"wall_s": wall, "loop_s": loop, "outside_loop_s": wall - loop, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list] = {"help_s": [], "train_help_s": [], "train": [], "reference": []}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        for k in range(args.repeats):
            runs["help_s"].append(_timed([*_shoal(), "--help"], work)[0])
            runs["train_help_s"].append(_timed([*_shoal(), "train", "--help"], work)[0])
            runs["train"].append(_train(args.iterations, work, k))
            runs["reference"].append(_reference(args.iterations, work))

    def median(rows: list[dict[str, float]]) -> dict[str, float]:
        return {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}

    train, reference = median(runs["train"]), median(runs["reference"])
    print(json.dumps({
        "benchmark": "cli_startup", "command": " ".join(_shoal()), "repeats": args.repeats,
        "iterations": args.iterations, "cpu_count": os.cpu_count(), "load_average_1min_at_start": round(load, 2),
        "help_s": round(statistics.median(runs["help_s"]), 3),
        "train_help_s": round(statistics.median(runs["train_help_s"]), 3), "train": train,
        "reference": reference,
        "outside_loop_over_reference_s": round(train["outside_loop_s"] - reference["outside_loop_s"], 3),
        "targets": {"help_s": 2.0, "train_help_s": 2.0, "train_outside_loop_s": 4.0},
        "runs": {key: [round(v, 3) if isinstance(v, float) else {k: round(x, 3) for k, x in v.items()}
                       for v in values] for key, values in runs.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
