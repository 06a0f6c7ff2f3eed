"""``shoal tune``: a Ray Tune hyper-parameter sweep from a config file, checked and reported here (Tune: ray_tune).

The file holds the usual ``TrainConfig`` keys (the base of every trial) and a ``search:`` section that maps
dotted keys to search spaces::

    env: builtin:cartpole
    iterations: 50
    rollout: {num_envs: 8}
    search:
      seed: {grid: [0, 1, 2]}            # every value, each a trial (grids multiply)
      lr: {loguniform: [1.0e-4, 1.0e-2]}  # sampled once per sample (--num-samples)
      ppo.clip_eps: {choice: [0.1, 0.2]}
      ppo:
        gamma: {uniform: [0.95, 0.999]}  # nested sections work too

Trials, their checkpoints and Tune's records go to ``STORAGE/NAME``; at the end the results table (trial,
searched values, iterations, env steps, final metric, status) is printed and written to
``STORAGE/NAME/results.csv`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import difflib
import json
import math
import numbers
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from orchestration.config import TrainConfig
from orchestration.config_kinds import allows, as_field_value, describe, field_hints
from orchestration.result_line import print_result, result_json


def config_from_params(base: TrainConfig, params: Mapping[str, Any]) -> TrainConfig:
    """``base`` with ``params`` applied; keys are dotted field paths (``"lr"``, ``"ppo.clip_eps"``), and a
    mapping under a section's name sets fields of that section (``{"ppo": {"clip_eps": 0.1}}``). Lists become
    tuples where the field is a tuple, and strings numbers where it is a float (YAML reads ``1e-3`` as a string).

    Raises:
        KeyError: naming a key that is no field of the config, and its nearest valid spelling.
        ValueError: a value the config's own validation refuses.
    """
    return _apply(base, params, "")


def field_value(base: Any, key: str) -> Any:
    """The value at dotted ``key`` of the config ``base``.

    Raises:
        KeyError: ``key`` names no field (with the nearest valid spelling) or goes into a plain value.
    """
    return _field(base, key, "")


def _field(base: Any, key: str, where: str) -> Any:
    value, full = base, where + key
    for part in key.split("."):
        if not dataclasses.is_dataclass(value):
            raise KeyError(f"unknown key '{full}': '{where.rstrip('.')}' is a value, not a section")
        names = [f.name for f in dataclasses.fields(value)]
        if part not in names:
            near = difflib.get_close_matches(part, names, n=1)
            hint = (f" (did you mean '{where}{near[0]}'?)" if near
                    else f"; valid keys: {', '.join(where + n for n in names)}")
            raise KeyError(f"unknown key '{where}{part}'{hint}")
        value, where = getattr(value, part), f"{where}{part}."
    return value


def _apply(base: Any, params: Mapping[str, Any], where: str) -> Any:
    nested: dict[str, dict[str, Any]] = {}
    changes: dict[str, Any] = {}
    hints = field_hints(type(base))
    for key, value in params.items():
        current = _field(base, key, where)
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        elif isinstance(value, Mapping) and dataclasses.is_dataclass(current):
            nested.setdefault(head, {}).update(value)
        else:
            changes[head] = _coerce(current, value, where + key, hints.get(head, Any))
    changes.update({head: _apply(getattr(base, head), sub, f"{where}{head}.") for head, sub in nested.items()})
    return dataclasses.replace(base, **changes)


def _coerce(current: Any, value: Any, key: str, hint: Any = Any) -> Any:
    """``value`` for the field ``key`` (annotated ``hint``, its value now ``current``) in the field's type: lists as
    tuples, numbers and number strings as floats where the field is a float (YAML 1.1 reads ``1e-3`` as a string).
    ValueError naming ``key`` for a value the annotation does not allow."""
    value = as_field_value(hint, value)  # lists as tuples, ``env_kwargs: {max_steps: 50}`` as its pairs, ...
    if isinstance(current, float) and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if allows(hint, value):  # numbers as Python's own (a search space may give numpy's)
        if isinstance(value, numbers.Number) and not isinstance(value, bool) and type(current) in (int, float):
            return type(current)(value)
        return value
    kind = "a section (a mapping of its keys)" if dataclasses.is_dataclass(current) else describe(hint)
    raise ValueError(f"key '{key}' takes {kind}, got {value!r}")


def run_trial(config: TrainConfig, trial_dir: str, restored: str | None,
              report: Callable[[dict[str, float], str | None], None]) -> None:
    """One trial of a sweep: trains ``config`` (from the checkpoint directory ``restored`` when Tune restarts
    it), writes every iteration's metrics to the config's loggers in ``trial_dir`` (so ``shoal plot`` draws
    trials as it draws runs) and calls ``report(metrics, checkpoint_dir)``: with a fresh checkpoint every
    ``checkpoint_every`` iterations and at the end (valid during the call only), else with None."""
    import tempfile

    import torch

    from orchestration.builder import build_trainer
    from orchestration.checkpoint import load_checkpoint, save_checkpoint
    from orchestration.metrics_log import MetricsLog
    from orchestration.run_notes import UnusedSettingWarning
    from orchestration.run_state import restore_trainer_, trainer_state

    torch.set_num_threads(config.threads)
    with warnings.catch_warnings():  # a sweep's --ray.* place Tune's trials, whatever backend each trial trains on
        warnings.simplefilter("ignore", UnusedSettingWarning)
        trainer = build_trainer(config)  # on the Ray backend: joins the Ray instance the trial runs in
    log = None
    try:
        if restored is not None:
            restore_trainer_(trainer, *load_checkpoint(restored))
            _carry_rows(Path(restored), Path(trial_dir))
        log = MetricsLog(trial_dir, config=config, resume=restored is not None, upto_iteration=trainer.iteration,
                         upto_env_steps=trainer.env_steps)
        while trainer.iteration < config.iterations:
            metrics = {k: float(v) for k, v in trainer.train().items()}
            log.write(trainer.env_steps, metrics)
            every = config.checkpoint_every
            if trainer.iteration == config.iterations or (every and trainer.iteration % every == 0):
                with tempfile.TemporaryDirectory() as directory:
                    weights, tensors, state = trainer_state(trainer)
                    save_checkpoint(directory, trainer.iteration, weights=weights, tensors=tensors, state=state,
                                    keep=1)
                    shutil.copyfile(log.csv_path, Path(directory) / _ROWS)  # the rows so far, for a restore
                    report(metrics, directory)
            else:
                report(metrics, None)
    finally:
        if log is not None:
            log.close()
        trainer.close()


_ROWS = "metrics.csv"  # a trial's rows so far, in each checkpoint it reports


def _carry_rows(checkpoint: Path, trial_dir: Path) -> None:
    """Puts the rows a restored checkpoint carries into ``trial_dir`` unless it has its own: an experiment
    restored by Tune runs its trials in new directories (a new Ray session's), whose ``metrics.csv`` would
    otherwise start at the checkpoint's iteration and replace the whole one in the experiment's storage."""
    rows, own = checkpoint / _ROWS, trial_dir / _ROWS
    if rows.is_file() and not own.exists():
        trial_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(rows, own)


SEARCH_KINDS = ("grid", "choice", "uniform", "loguniform")
"""The search spaces of a ``search:`` entry, as ``{KIND: [...]}``."""

HELP = __doc__.split("\n", 2)[2]


def check_search(base: TrainConfig, search: Mapping[str, Any]) -> dict[str, tuple[str, list]]:
    """``{dotted key: (kind, values)}`` of a ``search:`` section, every value checked against the config
    (:func:`orchestration.ray_tune.search_space` makes Tune's param space of it).

    Raises:
        KeyError: an unknown key (with its nearest valid spelling).
        ValueError: an unknown search kind, a malformed range, or a value the config refuses.
    """
    space: dict[str, tuple[str, list]] = {}
    for key, spec in _entries(base, search, ""):
        if not (isinstance(spec, Mapping) and len(spec) == 1):
            raise ValueError(f"search.{key}: expected one of " + ", ".join(f"{{{k}: [...]}}" for k in SEARCH_KINDS)
                             + f", got {spec!r}")
        (kind, values), = spec.items()
        if kind not in SEARCH_KINDS:
            near = difflib.get_close_matches(str(kind), SEARCH_KINDS, n=1)
            raise ValueError(f"search.{key}: unknown search {kind!r}" + (f" (did you mean {near[0]!r}?)" if near
                             else f"; the searches are {', '.join(SEARCH_KINDS)}"))
        if not isinstance(values, list) or not values:
            raise ValueError(f"search.{key}.{kind}: expected a non-empty list, got {values!r}")
        if kind in ("uniform", "loguniform"):
            values = [_number(key, kind, v) for v in values]
            if len(values) != 2 or not values[0] < values[1] or (kind == "loguniform" and values[0] <= 0):
                raise ValueError(f"search.{key}.{kind}: expected [low, high] with low < high"
                                 + (" and low > 0" if kind == "loguniform" else "") + f", got {values}")
        for value in values:  # a value the config refuses fails here, not in a trial
            try:
                config_from_params(base, {key: value})
            except ValueError as err:
                raise ValueError(f"search.{key}: {value!r} is refused: {err}") from None
        space[key] = (kind, values)
    return space


def _entries(base: TrainConfig, search: Mapping[str, Any], where: str):
    """``(dotted key, spec)`` pairs; a mapping under a section's name holds entries of that section."""
    for key, spec in search.items():
        dotted = f"{where}{key}"
        try:
            current = field_value(base, dotted)
        except KeyError as err:
            raise KeyError(f"search: {err.args[0]}") from None
        if isinstance(spec, Mapping) and hasattr(current, "__dataclass_fields__"):
            yield from _entries(base, spec, dotted + ".")
        else:
            yield dotted, spec


def _number(key: str, kind: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"search.{key}.{kind}: {value!r} is not a number") from None


def load_sweep(path: str) -> tuple[TrainConfig, dict[str, Any]]:
    """The base config and the ``search:`` section of a YAML or JSON sweep file."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of TrainConfig keys and a 'search' section")
    search = raw.pop("search", None)
    if not isinstance(search, dict) or not search:
        raise ValueError(f"{path}: no 'search' section (dotted keys mapped to {{grid: [...]}}, {{choice: [...]}}, "
                         "{uniform: [low, high]} or {loguniform: [low, high]})")
    try:
        return config_from_params(TrainConfig(), raw), search
    except KeyError as err:
        raise KeyError(f"{path}: {err.args[0]}") from None


def results_table(results, space_keys: list[str], metric: str, iterations: int) -> list[dict[str, Any]]:
    """One row per trial of a Tune ResultGrid: its id, searched values, progress, the last value of ``metric`` it
    reported (an evaluation's metric is not in every report), status: ``ok`` once it trained all its
    ``iterations`` (the base config's, unless searched), ``unfinished`` when an interrupt stopped it before
    (or before it started: no config, no metrics yet), else ``error: <type>``."""
    rows = []
    for result in results:
        m, params = dict(result.metrics or {}), dict(result.config or {})
        if m.get(metric) is None and result.metrics_dataframe is not None and metric in result.metrics_dataframe:
            values = result.metrics_dataframe[metric].dropna()
            m[metric] = float(values.iloc[-1]) if len(values) else None
        done = m.get("iteration") is not None and int(m["iteration"]) >= int(params.get("iterations", iterations))
        rows.append({"trial": m.get("trial_id") or Path(result.path).name,
                     **{k: params.get(k) for k in space_keys},
                     **{k: int(m[key]) if m.get(key) is not None else None
                        for k, key in (("iterations", "iteration"), ("env_steps", "env_steps"))},
                     metric: m.get(metric),
                     "status": f"error: {type(result.error).__name__}" if result.error is not None
                     else "ok" if done else "unfinished",
                     "checkpoint": result.checkpoint.path if result.checkpoint else None, "path": result.path})
    return sorted(rows, key=lambda r: r["trial"])


def _format(rows: list[dict[str, Any]]) -> str:
    shown = [{k: v for k, v in r.items() if k not in ("checkpoint", "path")} for r in rows]
    if not shown:
        return "(no trials)"
    cells = [[str(k) for k in shown[0]]] + [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()]
                                            for r in shown]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _check_env(base, space: Mapping[str, Any], config_file: str) -> None:
    """Builds the env once when no trial changes it: a misspelt id is told before Tune starts any trial."""
    if base.env == "external" or base.collection is not None or {"env", "env_kwargs"} & set(space):
        return
    from orchestration.envs import make_env, parse_kwargs
    from orchestration.user_errors import is_users_mistake

    try:
        make_env(base.env, 1, kwargs=parse_kwargs(base.env_kwargs)).close()
    except Exception as err:
        if not (isinstance(err, ValueError) or is_users_mistake(err, gymnasium=True)):
            raise
        raise ValueError(f"{config_file}: {err}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal tune", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Run a hyper-parameter sweep on Ray Tune.\n\n" + HELP)
    add = parser.add_argument
    add("--config-file", metavar="F", required=True, help="YAML or JSON: TrainConfig keys plus a 'search' section")
    add("--num-samples", metavar="N", type=int, default=1,
        help="samples of the search space; grids are repeated this many times (default 1)")
    add("--max-concurrent", metavar="N", type=int, default=None,
        help="most trials at once (default: as the Ray CPUs allow)")
    add("--cpus-per-trial", metavar="C", type=float, default=1.0, help="Ray CPUs reserved per trial (default 1)")
    add("--storage", metavar="DIR", default="runs/tune", help="directory of the experiments (default runs/tune)")
    add("--name", metavar="NAME", default=None,
        help="experiment name under --storage (default: the config file's name and the time)")
    add("--metric", metavar="M", default="episode_return_mean",
        help="the final metric of the results table and what 'best' means (default episode_return_mean)")
    add("--mode", choices=("max", "min"), default="max", help="best is the max or the min of --metric (default max)")
    add("--max-failures", metavar="N", type=int, default=0,
        help="restarts of a failed trial from its last checkpoint (default 0)")
    add("--resume", action="store_true", help="continue the interrupted experiment --storage/--name")
    add("--verbose", type=int, choices=(0, 1, 2), default=1, metavar="{0,1,2}",
        help="Tune's progress output: 0 none, 1 status tables, 2 every result (default 1)")
    return parser


def main(argv: list[str]) -> int:
    """``shoal tune --config-file F [options]``: 0 when every trial finished, 1 when some failed, 2 on a user
    error (one paragraph on stderr)."""
    args = _parser().parse_args(argv)
    try:
        base, search = load_sweep(args.config_file)
        for name, low in (("num_samples", 1), ("max_concurrent", 1), ("max_failures", 0), ("cpus_per_trial", 1e-9)):
            if getattr(args, name) is not None and getattr(args, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be {'> 0' if low < 1 else f'>= {low}'}, got "
                                 f"{getattr(args, name):g}")
        if args.resume and not args.name:
            raise ValueError("--resume continues an experiment: name it with --name (a directory under --storage)")
        if args.resume and not (Path(args.storage) / args.name / "tuner.pkl").is_file():
            kept = sorted(p.parent.name for p in Path(args.storage).glob("*/tuner.pkl"))
            raise ValueError(f"--resume: no experiment {args.name!r} under --storage {args.storage}"
                             + (f" (it has {', '.join(kept)})" if kept else " (it has none)"))
        space = check_search(base, search)
        _check_env(base, space, args.config_file)
        if args.metric.startswith("eval_") and not base.eval_every and "eval_every" not in space:
            raise ValueError(f"--metric {args.metric} is reported by evaluations, and the config has eval_every 0: set "
                             f"eval_every (e.g. to iterations) in {args.config_file}")
    except (ValueError, KeyError, FileNotFoundError, ImportError) as err:
        print(f"shoal tune: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    storage = Path(args.storage).resolve()
    name = args.name or f"{Path(args.config_file).stem}__{time.strftime('%Y%m%d-%H%M%S')}"
    from orchestration.ray_tune import run_tune, search_space

    results = run_tune(base, search_space(space), num_samples=args.num_samples,
                       max_concurrent_trials=args.max_concurrent, cpus_per_trial=args.cpus_per_trial,
                       storage_path=str(storage), name=name, max_failures=args.max_failures,
                       restore=args.resume, verbose=args.verbose)
    rows = results_table(results, list(space), args.metric, base.iterations)
    out = storage / name
    _write(rows, out)
    print(_format(rows))
    if rows and all(r.error is not None for r in results):  # said first: the metric is missing for this reason
        cause = getattr(results[0].error, "cause", None) or results[0].error  # a Ray task error's own exception
        said = (str(cause).strip().splitlines() or [""])[0]
        print(f"shoal tune: every trial failed, the first with {type(cause).__name__}: {said}; the results and each "
              f"trial's error.txt are under {out}", file=sys.stderr)
        return 1
    reported = sorted({k for r in results for k in (r.metrics or {}) if isinstance(r.metrics[k], (int, float))})
    if reported and all(r[args.metric] is None for r in rows):  # a misspelt metric: the trials are kept
        near = difflib.get_close_matches(args.metric, reported, n=1)
        print(f"shoal tune: no trial reported --metric {args.metric!r}"
              f"{f' (did you mean {near[0]!r}?)' if near else f'; the trials reported {reported}'}; the results are "
              f"in {out}", file=sys.stderr)
        return 2
    finite = [r for r in rows if r["status"] == "ok" and isinstance(r[args.metric], (int, float))
              and math.isfinite(r[args.metric])]  # best among the trials that trained all their iterations
    best = (max if args.mode == "max" else min)(finite, key=lambda r: r[args.metric]) if finite else None
    unfinished = sum(r["status"] == "unfinished" for r in rows)
    print_result({"experiment": str(out), "results": str(out / "results.csv"), "trials": len(rows),
                  "failed": sum(r["status"].startswith("error") for r in rows), "unfinished": unfinished,
                  "best": {k: best[k] for k in ("trial", *space, args.metric, "checkpoint")} if best else None})
    if unfinished:
        print(f"shoal tune: {unfinished} of {len(rows)} trials did not finish (interrupted); continue the sweep "
              f"with: shoal tune --config-file {args.config_file} --storage {args.storage} --name {name} "
              f"--resume", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _write(rows: list[dict[str, Any]], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(result_json(rows, indent=1, default=str))
    with open(directory / "results.csv", "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


__all__ = ["HELP", "SEARCH_KINDS", "check_search", "config_from_params", "field_value", "load_sweep", "main",
           "results_table", "run_trial"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
