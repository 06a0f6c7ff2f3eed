"""kill -9 a short ``shoal train`` run at many random moments, resuming after each, and report what survived.

    python -m tests.orchestration.chaos_runner WORKDIR --kills 50 --seed 7 -- TRAIN_ARGS...

One parent imports Shoal once and forks every run from it, so each of the many short runs costs its own
training, not torch's import: 50 kills fit in a test. Checkpoint writes are slowed (a sleep before each
tensor file, under a marker file); every 4th kill waits for the marker, so a quarter of the kills land inside
a write, and the report counts the kills that found the marker.

The parent never runs a torch op itself (a forked child of a process whose OpenMP pool exists can hang):
checks of a checkpoint run in a forked child too. It prints one JSON line:
``{"kills", "kills_in_writes", "runs", "bad_checkpoints", "failures"}``; each finished chaos run directory
is ``WORKDIR/chaos-K`` and the uninterrupted one ``WORKDIR/straight``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import orchestration.checkpoint as ckpt
from orchestration.cli import main as shoal

WRITE_DELAY_S = 0.05


def _fork(body) -> int:
    """Runs ``body()`` in a forked child (exit 0 if it returns, 1 if it raises); returns the child's pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        code = 1
        try:
            os.setpgid(0, 0)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            sys.stdout = sys.stderr = open(os.devnull, "w")
            body()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _valid(root: Path) -> bool:
    """Whether the checkpoint ``root`` resolves to loads (checked in a forked child: it runs torch ops)."""
    return _wait(_fork(lambda: ckpt.load_checkpoint(ckpt.resolve(root)))) == 0


def _slow_writes(marker: Path) -> None:
    real = ckpt._save_tensors

    def save(path, tensors):
        marker.touch()
        time.sleep(WRITE_DELAY_S)
        real(path, tensors)
        marker.unlink(missing_ok=True)

    ckpt._save_tensors = save


def _preimport() -> None:
    """Imports what every run imports on its way (TorchRL's data and objectives, matplotlib's figure for the
    learning curve) once, here: a forked run then starts in a fraction of a second instead of ~5 s. Importing
    runs no torch op, so forking stays safe."""
    for module in ("matplotlib.backends.backend_agg", "matplotlib.figure", "torchrl.data", "torchrl.objectives"):
        importlib.import_module(module)


def run(workdir: Path, kills: int, seed: int, train_args: list[str]) -> dict:
    """Kills runs of ``shoal train TRAIN_ARGS`` ``kills`` times at random moments (each a fresh fork that
    resumes the same run dir); when a run finishes before its kill, the next kills go to a fresh run dir."""
    rng, marker = random.Random(seed), workdir / "writing"
    _slow_writes(marker)
    _preimport()
    start = time.monotonic()
    if _wait(_fork(lambda: shoal(["train", *train_args, "--run-dir", str(workdir / "straight")]))) != 0:
        return {"failures": ["the uninterrupted run failed"]}
    duration = time.monotonic() - start
    report = {"kills": 0, "kills_in_writes": 0, "stuck": 0, "runs": 0, "bad_checkpoints": 0, "failures": []}
    run_dir = workdir / "chaos-0"
    while report["kills"] < kills:
        root = run_dir / "checkpoints"
        # a supervisor's one command: a kill between a checkpoint's rename and its pointer's leaves a checkpoint
        # without ``latest``; the run holds a checkpoint all the same, and only --resume=auto sees it as the CLI does
        pid = _fork(lambda: shoal(["train", "--resume=auto", *train_args, "--run-dir", str(run_dir)]))
        # every 4th kill waits for a checkpoint write to begin (its moment inside the write is random), so
        # kills inside writes happen whatever the machine's load; the others fall anywhere in the run
        in_write = report["kills"] % 4 == 3
        began, finished = time.monotonic(), None
        deadline = began + (3 * duration if in_write else rng.uniform(0.0, duration))
        while finished is None and time.monotonic() < deadline and not (in_write and marker.exists()):
            done, status = os.waitpid(pid, os.WNOHANG)
            finished = os.waitstatus_to_exitcode(status) if done else None
            time.sleep(0.001)
        if in_write and finished is None:
            if not marker.exists():  # no write began in 3 run-lengths: a stuck run (killed all the same)
                report["stuck"] += 1
            time.sleep(rng.uniform(0.0, WRITE_DELAY_S))
        if finished is not None:  # the run ended before its kill: check it, go on with a fresh run dir
            if finished != 0:
                report["failures"].append(f"{run_dir.name}: exit {finished} before its kill")
            report["runs"] += 1
            run_dir = workdir / f"chaos-{report['runs']}"
            continue
        os.kill(pid, signal.SIGKILL)
        _wait(pid)
        report["kills"] += 1
        report["kills_in_writes"] += marker.exists()
        marker.unlink(missing_ok=True)
        if any(root.glob("ckpt-*")) and not _valid(root):
            report["bad_checkpoints"] += 1
    if _wait(_fork(lambda: shoal(["train", "--resume=auto", *train_args, "--run-dir", str(run_dir)]))) != 0:
        report["failures"].append(f"{run_dir.name}: the final uninterrupted resume failed")
    report["runs"] += 1
    return report


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    at = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv[:at])
    print(json.dumps(run(args.workdir, args.kills, args.seed, argv[at + 1:])), flush=True)


if __name__ == "__main__":
    main()
