"""The ``shoal`` command: ``train``, ``evaluate`` and ``export``.

    shoal train CartPole-v1 --iterations 40                 # flags map onto TrainConfig (see --help)
    shoal train --config-file run.json --resume             # a JSON config file, flags override it
    shoal evaluate runs/shoal/checkpoints --episodes 20
    shoal export runs/shoal/checkpoints --out policy/       # torch.export programs, no Shoal needed to run them
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import torch
import tyro

from orchestration.checkpoint import load_checkpoint, save_checkpoint
from orchestration.config import TrainConfig
from orchestration.metrics_log import MetricsLog, plot_learning_curve
from orchestration.run_state import load_config, restore_trainer_, trainer_state


def _config_from_file(path: str) -> TrainConfig:
    with open(path) as f:
        raw = json.load(f)
    base = json.loads(json.dumps(dataclasses.asdict(TrainConfig())))
    for key, value in raw.items():
        if isinstance(value, dict):
            base[key].update(value)
        else:
            base[key] = value
    return load_config({"config": base})


def _split_train_args(argv: list[str]) -> tuple[list[str], str | None, bool, bool]:
    """Pulls out the positional env, ``--config-file``, ``--resume`` and ``--no-progress`` before tyro."""
    rest, config_file, resume, progress = [], None, False, True
    it = iter(argv)
    for arg in it:
        if arg == "--config-file":
            config_file = next(it)
        elif arg.startswith("--config-file="):
            config_file = arg.split("=", 1)[1]
        elif arg == "--resume":
            resume = True
        elif arg == "--no-progress":
            progress = False
        elif not arg.startswith("-") and not rest and "--env" not in argv:
            rest += ["--env", arg]
        else:
            rest.append(arg)
    return rest, config_file, resume, progress


def train(argv: Sequence[str]) -> dict[str, float]:
    """``shoal train [ENV] [--config-file F] [--resume] [--no-progress] [TrainConfig flags]``."""
    from tqdm import tqdm

    from orchestration.trainer import build_trainer

    rest, config_file, resume, progress = _split_train_args(list(argv))
    default = _config_from_file(config_file) if config_file else TrainConfig()
    ckpt_root = None
    if resume:
        ckpt_root = Path(default.run_dir if config_file else _run_dir_from(rest, default)) / "checkpoints"
        default = load_config(load_checkpoint(ckpt_root)[2])
    config = tyro.cli(TrainConfig, args=rest, default=default, prog="shoal train",
                      description="Train with PPO. ENV may be given as the first argument.")
    torch.set_num_threads(config.threads)
    run_dir = Path(config.run_dir)
    ckpt_root = run_dir / "checkpoints"
    if config.backend == "ray":
        from orchestration.ray_backend import build_ray_trainer

        trainer = build_ray_trainer(config)
    else:
        trainer = build_trainer(config)
    if resume:
        restore_trainer_(trainer, *load_checkpoint(ckpt_root))
    log = MetricsLog(run_dir, resume=resume)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1, default=str))
    bar = tqdm(total=config.iterations, initial=trainer.iteration, disable=not progress, unit="it",
               dynamic_ncols=True, file=sys.stdout)
    metrics: dict[str, float] = {}
    try:
        while trainer.iteration < config.iterations:
            metrics = trainer.train()
            log.write(trainer.env_steps, metrics)
            bar.update(1)
            bar.set_postfix(ret=f"{metrics['episode_return_mean']:.1f}", sps=f"{metrics['env_steps_per_s']:.0f}")
            if config.backend == "ray":  # fleet health and the per-stage pipeline monitor, every iteration
                shown = {k: round(v, 2) for k, v in metrics.items()
                         if k.startswith(("pipeline/", "fragments_", "workers_restarted", "learners_restarted"))}
                bar.write(f"iteration {trainer.iteration}: " + json.dumps(shown))
            if config.checkpoint_every and trainer.iteration % config.checkpoint_every == 0:
                save_checkpoint(ckpt_root, trainer.iteration, **_checkpoint_parts(trainer))
    finally:
        bar.close()
        log.close()
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
    save_checkpoint(ckpt_root, trainer.iteration, **_checkpoint_parts(trainer))
    png = plot_learning_curve(log.csv_path, run_dir / "learning_curve.png", title=config.env)
    final = {k: metrics.get(k, math.nan) for k in ("episode_return_mean", "episode_return_mean_10", "env_steps")}
    print(json.dumps({"run_dir": str(run_dir), "learning_curve": str(png) if png else None,
                      "checkpoint": str(ckpt_root), **final}))
    return metrics


def _checkpoint_parts(trainer):
    weights, tensors, state = trainer_state(trainer)
    return {"weights": weights, "tensors": tensors, "state": state}


def _run_dir_from(args: list[str], default: TrainConfig) -> str:
    for i, arg in enumerate(args):
        if arg == "--run-dir" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    return default.run_dir


def evaluate(checkpoint: tyro.conf.Positional[str], episodes: int = 10, num_envs: int = 4) -> float:
    """Plays ``episodes`` episodes with the deterministic policies of ``checkpoint``; prints the mean return."""
    from orchestration.trainer import build_trainer

    weights, tensors, state = load_checkpoint(checkpoint)
    config = dataclasses.replace(load_config(state), eval_every=1, eval_episodes=episodes,
                                 rollout=dataclasses.replace(load_config(state).rollout, num_envs=num_envs,
                                                             num_workers=1))
    trainer = build_trainer(config)
    for pid, learner in trainer.learners.items():
        learner.policy.load_state_dict({k.split("/", 1)[1]: v for k, v in weights.items() if k.startswith(f"{pid}/")})
        learner._published = learner._snapshot()
        learner.version = state["learners"][pid]["version"]
    results = trainer.evaluate(episodes)
    print(json.dumps({"checkpoint": str(checkpoint), "episodes": episodes, **results}))
    return results["eval_return_mean"]


def export(checkpoint: tyro.conf.Positional[str], out: str = "exported") -> list[str]:
    """Writes one ``torch.export`` program per policy (eval-only observations removed) plus ``manifest.json``."""
    from core.policies import deployable, export_policy, make_policies
    from core.specs import deployment_view, from_json, groups, rand, to_json

    weights, _, state = load_checkpoint(checkpoint)
    config, tree = load_config(state), from_json(state["tree"])
    policies = make_policies(tree, config.policy)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest, written = {"tree": to_json(deployment_view(tree)), "policies": {}}, []
    example = rand(tree, (2,), torch.Generator().manual_seed(0))
    for pid, policy in policies.items():
        policy.load_state_dict({k.split("/", 1)[1]: v for k, v in weights.items() if k.startswith(f"{pid}/")})
        policy.eval()
        program = export_policy(policy, example.get(pid))
        path = out_dir / f"{pid}.pt2"
        torch.export.save(program, str(path))
        view = deployable(policy)
        manifest["policies"][pid] = {"file": path.name, "agents": list(groups(tree)[pid].agent_names),
                                     "observation_keys": ["/".join(k) for k in view.observation_keys],
                                     "action_keys": ["/".join(k) for k in view.action_keys],
                                     "recurrent": view.recurrent}
        written.append(str(path))
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({"exported": written, "manifest": str(out_dir / "manifest.json")}))
    return written


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``shoal`` command."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "train":
        train(rest)
    elif command == "evaluate":
        tyro.cli(evaluate, args=rest, prog="shoal evaluate")
    elif command == "export":
        tyro.cli(export, args=rest, prog="shoal export")
    else:
        raise SystemExit(f"unknown command {command!r}: use train, evaluate or export")


if __name__ == "__main__":
    main()
