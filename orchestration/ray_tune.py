"""Sweeps on Ray Tune (seed 002): one trial is one run, :func:`orchestration.sweeps.run_trial` inside Tune's
:func:`trainable`; :func:`run_tune` runs a param space of dotted config keys (``{"lr": tune.grid_search([3e-4,
1e-3]), "seed": ...}``; ``shoal tune``: :func:`search_space` of a checked ``search:`` section). Tune needs
``ray[tune]`` and is imported only when used. Wiring only: what a trial trains is ``run_trial``'s.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Mapping

import ray

from orchestration.config import TrainConfig
from orchestration.ray_session import init_ray
from orchestration.sweeps import config_from_params, run_trial


def trainable(params: dict[str, Any], base: TrainConfig) -> None:
    """Tune function trainable: :func:`orchestration.sweeps.run_trial` with Tune's checkpoint and reports."""
    from ray import tune

    restored, config = tune.get_checkpoint(), config_from_params(base, params)
    trial_dir = tune.get_context().get_trial_dir()

    def report(metrics: dict[str, float], directory: str | None) -> None:
        tune.report(metrics, **({"checkpoint": tune.Checkpoint.from_directory(directory)} if directory else {}))

    with restored.as_directory() if restored is not None else contextlib.nullcontext() as directory:
        run_trial(config, trial_dir, directory, report)


def run_tune(base: TrainConfig, param_space: Mapping[str, Any], *, num_samples: int = 1,
             max_concurrent_trials: int | None = None,
             cpus_per_trial: float = 1.0, storage_path: str | None = None, name: str | None = None,
             max_failures: int = 0, restore: bool = False, verbose: int = 0):
    """One trial per point of ``param_space`` (times ``num_samples``); Tune's ResultGrid. Tune is told no metric
    (one some reports lack would end trials): pick one in ``get_best_result``. Runs in this process's Ray, or in
    one it starts and shuts down.

    Args:
        base: the config every trial starts from.
        param_space: dotted config keys -> values or Tune search spaces (``tune.grid_search``, ``tune.choice``).
        num_samples: repetitions of the space (random searches sample this many points).
        max_concurrent_trials: cap on trials running at once (None: as resources allow).
        cpus_per_trial: Ray CPUs reserved by each trial.
        storage_path: where Tune writes results and checkpoints (None: Tune's default, ``~/ray_results``).
        name: experiment name under ``storage_path``.
        max_failures: restarts of a failed trial (from its last checkpoint) before it counts as failed.
        restore: continue the interrupted experiment ``storage_path/name`` (unfinished and failed trials).
        verbose: Tune's console output (0: none, 1: status tables, 2: every result).
    """
    from ray import tune

    owns_ray = init_ray(base, base.ray)
    try:
        fn = tune.with_resources(tune.with_parameters(trainable, base=base), {"cpu": cpus_per_trial})
        if restore:
            if not (storage_path and name):
                raise ValueError("restoring a Tune experiment needs its storage path and name")
            return tune.Tuner.restore(str(Path(storage_path) / name), fn, resume_unfinished=True,
                                      resume_errored=True).fit()
        failures, kept = tune.FailureConfig(max_failures=max_failures), tune.CheckpointConfig(num_to_keep=2)
        return tune.Tuner(fn, param_space=dict(param_space),
                          tune_config=tune.TuneConfig(num_samples=num_samples,
                                                      max_concurrent_trials=max_concurrent_trials),
                          run_config=tune.RunConfig(storage_path=storage_path, name=name, verbose=verbose,
                                                    failure_config=failures, checkpoint_config=kept)).fit()
    finally:
        if owns_ray:
            ray.shutdown()


def search_space(checked: Mapping[str, tuple[str, list]]) -> dict[str, Any]:
    """Tune's param space from :func:`orchestration.sweeps.check_search`'s ``{key: (kind, values)}``."""
    from ray import tune

    return {key: tune.grid_search(values) if kind == "grid" else tune.choice(values) if kind == "choice"
            else getattr(tune, kind)(*values) for key, (kind, values) in checked.items()}


__all__ = ["run_tune", "search_space", "trainable"]
