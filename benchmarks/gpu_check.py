"""The GPU check of issues 18 and 13 in one run, for a machine with CUDA (the ``device`` tool's), printed as JSON.

1. ``cartpole``: ``builtin:cartpole`` trained end to end with the env, the acting, the fragments and the learner on
   ``--device`` (``--env-kwargs device=<device>``: the actor acts where its env steps) at each of ``--sizes`` envs,
   fragments of ``--steps`` steps: one warm-up iteration, then ``--iterations`` timed ones. Per size: env steps/s
   of the collection (``collect_env_steps_per_s``: env steps over sampling time) and of whole iterations (training
   included), the device's peak memory (``torch.cuda.max_memory_allocated``, None on the CPU) and that peak per
   stored transition; beside them the raw dynamics on bare tensors on the same device (``raw_env_steps_per_s``,
   random actions: the limit of the collection).
2. ``vmas``: ``vmas:navigation`` (3 agents, MAPPO with the joint critic, 2 x 256 networks as
   ``benchmarks/vmas_mappo.py``) on the device at each of ``--vmas-sizes`` envs, in float32 and bfloat16: frames/s
   and peak memory.
3. ``inference``: ``benchmarks/inference_service.py`` on the device (1, 16 and 64 callers), its JSON as it prints it.
4. ``ray``: ``shoal train builtin:cartpole --backend ray`` with a CUDA env in each rollout worker
   (``--ray.worker-num-gpus``) and the learner on CUDA: exit code and the last lines of its output.

Without CUDA, ``--device cpu`` runs the same parts on the CPU (the smoke test runs ``cartpole`` at 64 envs).

    python benchmarks/gpu_check.py [--device cuda] [--sizes 4096 16384 65536] [--vmas-sizes 4096 16384]
        [--parts cartpole vmas inference ray] [--iterations 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def raw_cartpole(n: int, device: torch.device, steps: int = 200) -> float:
    """Env steps/s of CartPole's dynamics, partial resets and step counters on bare tensors on ``device``."""
    from adapters.builtin.cartpole import cartpole_dynamics, initial_states

    generator = torch.Generator(device=device).manual_seed(0)
    state = initial_states(n, generator, torch.float32, device)
    counts = torch.zeros(n, dtype=torch.int64, device=device)
    for timed in (False, True):
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps if timed else 10):
            state, terminated = cartpole_dynamics(state, torch.randint(0, 2, (n,), generator=generator, device=device))
            counts += 1
            ended = terminated | (counts >= 500)
            fresh = initial_states(n, generator, torch.float32, device)
            state = torch.where(ended, fresh, state)  # no host sync: every env draws, the ended take it
            counts = counts.masked_fill(ended, 0)
        _sync(device)
    return n * steps / (time.perf_counter() - start)


def train_rate(env: str, kwargs: dict, n: int, steps: int, iterations: int, device: torch.device,
               **overrides) -> dict:
    """A trainer of ``env`` with ``n`` envs on ``device``: rates of ``iterations`` timed iterations and peak memory."""
    from orchestration.builder import build_trainer
    from orchestration.config import RolloutConfig, TrainConfig

    config = TrainConfig(env=env, env_kwargs=tuple((k, repr(v)) for k, v in {**kwargs, "device": str(device)}.items()),
                         device=str(device), eval_every=0, iterations=10**6,
                         rollout=RolloutConfig(num_envs=n, fragment_length=steps), **overrides)
    trainer = build_trainer(config)
    try:
        trainer.train()  # warm-up: first-use costs, the allocator's pools
        _reset_peak(device)
        sampling, wall, metrics = 0.0, 0.0, {}
        for _ in range(max(iterations, 1)):
            metrics = trainer.train()
            sampling += metrics["time_collect"]
            wall += metrics["time_iteration"]
        actor_device = str(trainer.fleet.actors[0].device) if hasattr(trainer.fleet, "actors") else None
    finally:
        trainer.close()
    frames = n * steps * max(iterations, 1)
    peak = _peak(device)
    return {"collect_env_steps_per_s": round(frames / sampling), "env_steps_per_s": round(frames / wall),
            "peak_bytes": peak, "peak_bytes_per_transition": None if peak is None else round(peak / (n * steps)),
            "actor_device": actor_device, "return_mean": _number(metrics.get("episode_return_mean"))}


def _number(x) -> float | None:
    """``x``, or None where no episode ended (NaN is not JSON)."""
    return None if x is None or x != x else round(float(x), 3)


def ray_run(device: torch.device) -> dict:
    command = [sys.executable, "-m", "orchestration.cli", "train", "builtin:cartpole", "--backend", "ray",
               "--iterations", "3", "--device", str(device), "--env-kwargs", "device", str(device),
               "--rollout.num-workers", "2", "--rollout.num-envs", "1024", "--rollout.fragment-length", "32",
               "--ray.num-cpus", "4", "--ray.worker-num-gpus", "0.25" if device.type == "cuda" else "0",
               "--run-dir", str(Path(tempfile.mkdtemp(prefix="shoal-gpu-check-")) / "ray"), "--no-progress"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return {"command": " ".join(command[2:]), "returncode": done.returncode,
            "tail": (done.stdout + done.stderr).strip().splitlines()[-6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--vmas-sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--parts", nargs="+", default=["cartpole", "vmas", "inference", "ray"],
                        choices=["cartpole", "vmas", "inference", "ray"])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    result: dict = {"benchmark": "gpu_check", "device": str(device), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    if "cartpole" in args.parts:
        result["cartpole"] = {str(n): {**train_rate("builtin:cartpole", {}, n, args.steps, args.iterations, device),
                                       "raw_env_steps_per_s": round(raw_cartpole(n, device))} for n in args.sizes}
    if "vmas" in args.parts:
        from core.losses import PPOConfig
        from core.policies import PolicyConfig

        vmas = {"n_agents": 3, "continuous_actions": True, "max_steps": 100}
        result["vmas"] = {f"{n}/{dtype}": train_rate(
            "vmas:navigation", vmas, n, 10, args.iterations, device,
            policy=PolicyConfig(hidden_sizes=(256, 256), critic="joint"),
            ppo=PPOConfig(num_epochs=10, minibatch_size=max(n * 10 // 15, 1), gae_lambda=0.9, compute_dtype=dtype))
            for n in args.vmas_sizes for dtype in ("float32", "bfloat16")}
    if "inference" in args.parts:
        done = subprocess.run([sys.executable, "benchmarks/inference_service.py", "--device", str(device),
                               "--rounds", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = done.stdout.strip().splitlines()
        result["inference"] = json.loads("\n".join(lines)) if done.returncode == 0 else {"error": done.stderr[-2000:]}
    if "ray" in args.parts:
        result["ray"] = ray_run(device)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
