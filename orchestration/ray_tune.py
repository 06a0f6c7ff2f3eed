"""Parallel experiment runs with Ray Tune (seed 002: hyper-parameter searches and seeds run side by side).

One trial is one training run: a function trainable builds the run from a base :class:`TrainConfig` and
the trial's sampled values (dotted keys into the config), trains ``config.iterations`` iterations on the
backend the config names, and reports every iteration's metrics to Tune::

    results = run_tune(TrainConfig(env="builtin:cartpole", iterations=20),
                       {"lr": tune.grid_search([3e-4, 1e-3]), "seed": tune.grid_search([0, 1]),
                        "ppo.clip_eps": tune.choice([0.1, 0.2])})
    best = results.get_best_result("episode_return_mean", "max")

A trial writes its metrics to the loggers its config names (``metrics.csv`` and TensorBoard in the trial's
directory by default, so ``shoal plot`` draws trials as it draws runs) and hands Tune a Shoal checkpoint every
``checkpoint_every`` iterations and at its end: Tune keeps it under the storage path, and a trial that Tune
restarts after a failure (``max_failures``) or an experiment it restores continues from it. ``shoal tune``
(:mod:`orchestration.sweeps`) runs a sweep described in a config file.

Needs ``ray[tune]`` (pandas, pyarrow, tensorboardX); Tune is imported only when used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from orchestration.config import TrainConfig
from orchestration.sweeps import config_from_params, run_trial


def trainable(params: dict[str, Any], base: TrainConfig) -> None:
    """Tune function trainable: :func:`orchestration.sweeps.run_trial` with Tune's checkpoint and reports."""
    from ray import tune

    restored = tune.get_checkpoint()

    def report(metrics: dict[str, float], directory: str | None) -> None:
        tune.report(metrics, **({"checkpoint": tune.Checkpoint.from_directory(directory)} if directory else {}))

    if restored is None:
        run_trial(config_from_params(base, params), tune.get_context().get_trial_dir(), None, report)
    else:
        with restored.as_directory() as directory:
            run_trial(config_from_params(base, params), tune.get_context().get_trial_dir(), directory, report)


def run_tune(base: TrainConfig, param_space: Mapping[str, Any], *, num_samples: int = 1,
             metric: str = "episode_return_mean", mode: str = "max", max_concurrent_trials: int | None = None,
             cpus_per_trial: float = 1.0, storage_path: str | None = None, name: str | None = None,
             max_failures: int = 0, restore: bool = False, verbose: int = 0):
    """Runs one trial per point of ``param_space`` (times ``num_samples``) in parallel; returns Tune's ResultGrid.

    Args:
        base: the config every trial starts from.
        param_space: dotted config keys -> values or Tune search spaces (``tune.grid_search``, ``tune.choice``).
        num_samples: repetitions of the space (random searches sample this many points).
        metric, mode: what "best" means for ``ResultGrid.get_best_result``.
        max_concurrent_trials: cap on trials running at once (None: as resources allow).
        cpus_per_trial: Ray CPUs reserved by each trial.
        storage_path: where Tune writes results and checkpoints (None: Tune's default, ``~/ray_results``).
        name: experiment name under ``storage_path``.
        max_failures: restarts of a failed trial (from its last checkpoint) before it counts as failed.
        restore: continue the interrupted experiment ``storage_path/name`` (unfinished and failed trials).
        verbose: Tune's console output (0: none, 1: status tables, 2: every result).
    """
    from ray import tune

    from orchestration.ray_session import init_ray

    init_ray(base, base.ray)
    fn = tune.with_resources(tune.with_parameters(trainable, base=base), {"cpu": cpus_per_trial})
    if restore:
        if not (storage_path and name):
            raise ValueError("restoring a Tune experiment needs its storage path and name")
        return tune.Tuner.restore(str(Path(storage_path) / name), fn, resume_unfinished=True,
                                  resume_errored=True).fit()
    tuner = tune.Tuner(fn, param_space=dict(param_space),
                       tune_config=tune.TuneConfig(num_samples=num_samples, metric=metric, mode=mode,
                                                   max_concurrent_trials=max_concurrent_trials),
                       run_config=tune.RunConfig(storage_path=storage_path, name=name, verbose=verbose,
                                                 failure_config=tune.FailureConfig(max_failures=max_failures),
                                                 checkpoint_config=tune.CheckpointConfig(num_to_keep=2)))
    return tuner.fit()


def search_space(checked: Mapping[str, tuple[str, list]]) -> dict[str, Any]:
    """Tune's param space from :func:`orchestration.sweeps.check_search`'s ``{key: (kind, values)}``."""
    from ray import tune

    return {key: tune.grid_search(values) if kind == "grid" else tune.choice(values) if kind == "choice"
            else getattr(tune, kind)(*values) for key, (kind, values) in checked.items()}


def run_sweep(base: TrainConfig, checked: Mapping[str, tuple[str, list]], **kwargs: Any):
    """:func:`run_tune` over a checked search section, in the Ray instance running (or one started for it and
    shut down after)."""
    import ray

    from orchestration.ray_session import init_ray

    owns_ray = init_ray(base, base.ray)
    try:
        return run_tune(base, search_space(checked), **kwargs)
    finally:
        if owns_ray:
            ray.shutdown()


__all__ = ["run_sweep", "run_tune", "search_space", "trainable"]
