"""Parallel experiment runs with Ray Tune (seed 002: hyper-parameter searches and seeds run side by side).

One trial is one training run: a function trainable builds the run from a base :class:`TrainConfig` and
the trial's sampled values (dotted keys into the config), trains ``config.iterations`` iterations on the
backend the config names, and reports every iteration's metrics to Tune::

    results = run_tune(TrainConfig(env="builtin:cartpole", iterations=20),
                       {"lr": tune.grid_search([3e-4, 1e-3]), "seed": tune.grid_search([0, 1]),
                        "ppo.clip_eps": tune.choice([0.1, 0.2])})
    best = results.get_best_result("episode_return_mean", "max")

Needs ``ray[tune]`` (pandas, pyarrow, tensorboardX); Tune is imported only when used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from orchestration.config import TrainConfig


def config_from_params(base: TrainConfig, params: Mapping[str, Any]) -> TrainConfig:
    """``base`` with ``params`` applied; keys are dotted field paths: ``"lr"``, ``"ppo.clip_eps"``.

    Raises:
        KeyError: naming a key that is no field of the config.
    """
    nested: dict[str, Any] = {}
    for key, value in params.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            nested[head] = value
    names = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(nested) - names)
    if unknown:
        raise KeyError(f"{type(base).__name__} has no fields {unknown}")
    changes = {k: config_from_params(getattr(base, k), v) if isinstance(v, dict) else v for k, v in nested.items()}
    return dataclasses.replace(base, **changes)


def trainable(params: dict[str, Any], base: TrainConfig) -> None:
    """Tune function trainable: one run of ``config_from_params(base, params)``, metrics reported per iteration."""
    from ray import tune

    from orchestration.builder import build_trainer

    config = config_from_params(base, params)
    trainer = build_trainer(config)  # on the Ray backend: joins the Ray instance the trial runs in
    try:
        while trainer.iteration < config.iterations:
            metrics = trainer.train()
            tune.report({k: float(v) for k, v in metrics.items()})
    finally:
        trainer.close()


def run_tune(base: TrainConfig, param_space: Mapping[str, Any], *, num_samples: int = 1,
             metric: str = "episode_return_mean", mode: str = "max", max_concurrent_trials: int | None = None,
             cpus_per_trial: float = 1.0, storage_path: str | None = None, name: str | None = None):
    """Runs one trial per point of ``param_space`` (times ``num_samples``) in parallel; returns Tune's ResultGrid.

    Args:
        base: the config every trial starts from.
        param_space: dotted config keys -> values or Tune search spaces (``tune.grid_search``, ``tune.choice``).
        num_samples: repetitions of the space (random searches sample this many points).
        metric, mode: what "best" means for ``ResultGrid.get_best_result``.
        max_concurrent_trials: cap on trials running at once (None: as resources allow).
        cpus_per_trial: Ray CPUs reserved by each trial.
        storage_path: where Tune writes results (None: Tune's default, ``~/ray_results``).
        name: experiment name under ``storage_path``.
    """
    from ray import tune

    from orchestration.ray_session import init_ray

    init_ray(base, base.ray)
    fn = tune.with_resources(tune.with_parameters(trainable, base=base), {"cpu": cpus_per_trial})
    tuner = tune.Tuner(fn, param_space=dict(param_space),
                       tune_config=tune.TuneConfig(num_samples=num_samples, metric=metric, mode=mode,
                                                   max_concurrent_trials=max_concurrent_trials),
                       run_config=tune.RunConfig(storage_path=storage_path, name=name, verbose=0))
    return tuner.fit()


__all__ = ["config_from_params", "run_tune", "trainable"]
