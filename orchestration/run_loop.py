"""The loop of ``shoal train`` around a built trainer: metrics, checkpoints (periodic, timed, on a signal or an
error), the progress line, provenance. ``orchestration.cli`` parses and builds; this module runs."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from orchestration.checkpoint import save_checkpoint
from orchestration.config import TrainConfig
from orchestration.external_config import ACTIVITY_COUNTERS
from orchestration.fleet import CollectionInterrupted
from orchestration.metrics_log import MetricsLog, plot_learning_curve, read_csv
from orchestration.result_line import print_result, result_json
from orchestration.run_notes import note_stale
from orchestration.run_state import config_to_dict, trainer_state
from orchestration.signals import StopAfterIteration, deferred_interrupts


def run_training(trainer, config: TrainConfig, resume: bool, progress: bool,
                 command: str = "train") -> dict[str, float]:
    """The training loop of ``shoal train`` (``command`` names it in messages: ``serve`` trains too): metrics,
    checkpoints, signals."""
    from tqdm import tqdm

    run_dir = Path(config.run_dir)
    ckpt_root = run_dir / "checkpoints"
    if resume:
        if trainer.resume_gaps:
            print(f"shoal {command} --resume: this continuation is not bit-identical to an uninterrupted run: "
                  + ", and ".join(trainer.resume_gaps) + "; learners, optimizers and schedules are restored exactly.",
                  file=sys.stderr)
    try:
        log = MetricsLog(run_dir, resume=resume, upto_iteration=trainer.iteration if resume else None,
                         upto_env_steps=trainer.env_steps if resume else None, config=config)
    except BaseException as err:  # a tracker's missing package is a user error, told before training starts
        trainer.close()
        if not isinstance(err, ImportError):
            raise
        print(f"shoal {command}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=1))  # no token: not a secret
    write_provenance(run_dir, resume)
    # on stderr: stdout is the result line alone (``shoal train ... | jq`` reads it)
    bar = tqdm(total=config.iterations, initial=trainer.iteration, disable=not progress, unit="it",
               dynamic_ncols=True, file=sys.stderr)
    metrics: dict[str, float] = {}
    last_save = time.monotonic()
    saved = _trained_state(trainer) if resume else None  # what the newest checkpoint on disk holds

    def checkpoint() -> None:
        nonlocal last_save, saved
        if saved == _trained_state(trainer):  # the same state again would push an older checkpoint out
            return
        save_checkpoint(ckpt_root, trainer.iteration, **_checkpoint_parts(trainer), keep=config.keep_checkpoints)
        last_save, saved = time.monotonic(), _trained_state(trainer)

    stopped, told_stale = None, False
    try:
        with StopAfterIteration(trainer.interrupt) as stop:
            while trainer.iteration < config.iterations and stop.signal is None:
                try:
                    metrics = trainer.train()
                except CollectionInterrupted:
                    break  # a signal while no data came: nothing was trained in this iteration
                log.write(trainer.env_steps, metrics)
                bar.update(1)
                faults = env_faults(metrics)
                told_stale = told_stale or note_stale(command, config, metrics)
                wins = {k.split("/", 1)[1]: f"{v:.2f}" for k, v in metrics.items() if k.startswith("win_rate/")}
                teams = {k.rsplit("/", 1)[1]: f"{v:.1f}" for k, v in metrics.items()
                         if k.startswith("episode_return_mean/group/")}
                headline = ({"win": "/".join(wins.values())} if wins else  # zero-sum: the summed return is 0
                            {"ret": "/".join(teams.values())} if len(teams) > 1 else
                            {"ret": f"{metrics['episode_return_mean']:.1f}"})
                bar.set_postfix(**headline, sps=f"{metrics['wall_env_steps_per_s']:.0f}",  # training included
                                **({"env_faults": faults} if faults else {}))
                if config.backend == "ray":  # fleet health and the per-stage pipeline monitor, every iteration,
                    shown = {k: round(v, 2) for k, v in metrics.items()  # on stderr: stdout ends with the result
                             if k.startswith(("pipeline/", "fragments_", "workers_restarted", "learners_restarted"))}
                    bar.write(f"iteration {trainer.iteration}: " + result_json(shown), file=sys.stderr)
                due = config.checkpoint_every and trainer.iteration % config.checkpoint_every == 0
                late = config.checkpoint_every_s and time.monotonic() - last_save >= config.checkpoint_every_s
                if due or late:
                    checkpoint()
            stopped = stop.signal
        checkpoint()
    except BaseException:
        _save_anyway(checkpoint)  # what was trained so far survives an env error, a logger's or Ctrl-C
        raise
    finally:
        bar.close()
        log.close()
        trainer.close()
    settled = trainer.accounting()  # after close: what no learner got is lost, nothing is in flight any more
    record_final_accounting(run_dir, settled)
    if stopped is not None:
        exit_stopped(command, stopped, trainer.iteration, run_dir)
    png = plot_learning_curve(log.csv_path, run_dir / "learning_curve.png", title=config.env)
    if not metrics:  # nothing left to train (a resumed run that had finished): the figures logged last
        print(f"shoal {command}: the run is at iteration {trainer.iteration} already (--iterations "
              f"{config.iterations}); nothing was trained (raise --iterations to train on)", file=sys.stderr)
        metrics = _last_logged(log.csv_path)
    final = {k: metrics.get(k, math.nan) for k in ("episode_return_mean", "episode_return_mean_10")}
    final["env_steps"] = trainer.env_steps
    print_result({"run_dir": str(run_dir), "learning_curve": str(png) if png else None,
                  "checkpoint": str(ckpt_root), **final, "accounting": settled})
    return metrics


def exit_stopped(command: str, signum: int, iteration: int, run_dir: Path) -> None:
    """Ends a run that a signal stopped after ``iteration``: the way to continue it, and exit 128 + ``signum``."""
    print(f"shoal {command}: stopped by {signal.Signals(signum).name} after iteration {iteration}; "
          f"continue with: shoal {command} --resume --run-dir {run_dir}", file=sys.stderr)
    raise SystemExit(128 + signum)


def env_faults(metrics: dict[str, float]) -> int:
    """The progress line's ``env_faults``: the ``env/*`` counters (lenient truncations, restarts, timeouts, refused
    or cut connections...) summed, leaving out the external fleet's normal traffic (``ACTIVITY_COUNTERS``)."""
    return int(sum(v for k, v in metrics.items() if k.startswith("env/") and k not in ACTIVITY_COUNTERS))


def _trained_state(trainer) -> tuple:
    """What tells two checkpoints of a run apart: its iteration and every policy's weights version (a learner
    that trained in an iteration that then failed moved its version). Collected data that no iteration trained
    on is not in it: a fleet restores its actors at an iteration's boundary and collects it again."""
    return trainer.iteration, tuple(sorted((pid, version) for pid, (version, _) in trainer.weights.items()))


def _last_logged(csv_path: Path) -> dict[str, float]:
    """Each column's last non-empty cell in the metrics CSV (the figures logged last), or nothing without one."""
    columns = read_csv(csv_path) if csv_path.exists() else {}
    return {k: next((v for v in reversed(values) if not math.isnan(v)), math.nan) for k, values in columns.items()}


def _save_anyway(checkpoint) -> None:
    """Writes a checkpoint on the way out of a failed iteration; a failure to do so must not hide the error, and a
    second Ctrl-C must not cut it short (what was trained since the last checkpoint would be lost)."""
    try:
        with deferred_interrupts():
            checkpoint()
    except Exception as err:  # noqa: BLE001 -- reported, then the original error propagates
        print(f"shoal train: could not write a checkpoint after the error ({err})", file=sys.stderr)


def _checkpoint_parts(trainer):
    weights, tensors, state = trainer_state(trainer)
    return {"weights": weights, "tensors": tensors, "state": state}


def fresh_run_dir(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... when a run started in the same second took it."""
    candidate, k = path, 1
    while candidate.exists():
        k += 1
        candidate = path.with_name(f"{path.name}-{k}")
    return candidate


_HELD: dict[str, int] = {}  # run directory -> descriptor of its lock file, while this process runs in it


def hold_run_dir(run_dir: str | Path) -> None:
    """Takes ``RUN_DIR/.lock`` for this process (an exclusive ``flock``, released by :func:`release_run_dir` or
    when the process ends; taking it again in the same process is a no-op): a second ``shoal`` process in the
    same directory would interleave its checkpoints and metrics with this one's, and clean up its half-written
    checkpoint as stale.

    Raises:
        ValueError: another process holds it, naming the directory and that process.
    """
    import fcntl
    import os
    import tempfile

    path = Path(run_dir)
    key = str(path.resolve())
    if key in _HELD:
        return
    try:  # a directory this run cannot write to fails now, not after its first iterations (they would be lost)
        path.mkdir(parents=True, exist_ok=True)
        for place in (path, path / "checkpoints"):
            if place.is_dir():
                tempfile.TemporaryFile(dir=place).close()
        for name in ("metrics.csv", "run.json", "config.json"):
            if (path / name).is_file():
                open(path / name, "a").close()
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ValueError(f"--run-dir {run_dir}: {err.strerror or err} ({err.filename or path}): the run could "
                         f"not write its files there; give a directory it can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 16).decode(errors="replace").strip()
        os.close(fd)
        raise ValueError(f"{run_dir} is in use by another shoal process (pid {holder or '?'}): two runs in one "
                         f"directory would mix their checkpoints and metrics. Wait for it to end, or use another "
                         f"--run-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[key] = fd


@contextlib.contextmanager
def run_dir_held(run_dir: str | Path):
    """:func:`hold_run_dir` for a run's set-up: released when the block raises (the run never starts), kept
    for the run otherwise (its end releases it)."""
    hold_run_dir(run_dir)
    try:
        yield
    except BaseException:
        release_run_dir(run_dir)
        raise


def release_run_dir(run_dir: str | Path) -> None:
    """Lets :func:`hold_run_dir`'s lock of ``run_dir`` go (no-op when this process does not hold it)."""
    import os

    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases its flock


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--external.token`` replaced (run.json is not a secret; the run keeps its token
    in its own 0600 file)."""
    out = list(argv)
    for i, arg in enumerate(argv):
        flag = arg.split("=", 1)[0].replace("_", "-")
        if flag == "--external.token" and "=" in arg:
            out[i] = f"{arg.split('=', 1)[0]}=<redacted>"
        elif flag == "--external.token" and i + 1 < len(argv):
            out[i + 1] = "<redacted>"
    return out


def provenance() -> dict[str, Any]:
    """What produced a run: Shoal's version and git commit, the command line, library versions, the host."""
    import importlib.metadata
    import platform
    import subprocess

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"shoal_version": version("shoal"), "git_commit": commit, "argv": redacted(sys.argv), "started": time.time(),
            "python": platform.python_version(), "torch": torch.__version__, "ray": version("ray"),
            "torchrl": version("torchrl"), "tensordict": version("tensordict"), "host": platform.node()}


def write_provenance(run_dir: Path, resume: bool) -> None:
    """Writes ``run.json``: the :func:`provenance` of the run's start, with, on a resume, each resume's command
    line, time, commit and host appended under ``resumes`` (the first command line is kept)."""
    now, path = provenance(), run_dir / "run.json"
    try:
        first = json.loads(path.read_text()) if resume else None
    except (OSError, ValueError):  # none, or not JSON: this run's start is the oldest record left
        first = None
    if isinstance(first, dict):
        resumes = first.get("resumes") if isinstance(first.get("resumes"), list) else []
        first.pop("final_accounting", None)  # the interrupted segment's: this one writes its own when it ends
        now = {**first, "resumes": [*resumes, {k: now[k] for k in ("argv", "started", "git_commit", "host")}]}
    path.write_text(json.dumps(now, indent=1))


def record_final_accounting(run_dir: Path, settled: dict[str, Any]) -> None:
    """Adds the settled fragment accounting of the run's end (:meth:`Trainer.close`: fragments still in flight
    at the last iteration's row are accepted or lost by then) to ``run.json`` as ``final_accounting`` (a league's:
    one such record per player)."""
    path = run_dir / "run.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # removed or damaged while the run trained: the accounting alone
        record = {}
    path.write_text(result_json({**(record if isinstance(record, dict) else {}), "final_accounting": settled},
                                indent=1))


__all__ = ["env_faults", "exit_stopped", "fresh_run_dir", "hold_run_dir", "provenance", "record_final_accounting",
           "release_run_dir", "run_dir_held", "run_training", "write_provenance"]
