"""Where metrics go: the run's loggers (CSV, TensorBoard, W&B, MLflow), and a learning-curve PNG at the end.

The only effectful sink of training metrics; everything upstream returns plain dicts of numbers.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from orchestration.config import TrainConfig


class MetricsLog:
    """Sends one row of scalar metrics per iteration to every logger of the run (:mod:`orchestration.loggers`):
    ``DIR/metrics.csv`` and TensorBoard by default, Weights & Biases and MLflow when named.

    A key that appears later (evaluation metrics every N iterations, a win rate once a game ends) adds a
    column to the CSV (earlier rows get empty cells), so its header always describes every row.
    """

    def __init__(self, directory: str | Path, *, loggers: Sequence[str] | None = None, tensorboard: bool = True,
                 resume: bool = False, upto_iteration: int | None = None, upto_env_steps: int | None = None,
                 config: TrainConfig | None = None) -> None:
        """Opens the loggers.

        Args:
            directory: the run directory.
            loggers: names from :data:`orchestration.loggers.LOGGER_NAMES` (None: ``config.loggers``, else
                ``("csv", "tensorboard")``).
            tensorboard: False leaves TensorBoard out whatever ``loggers`` says.
            resume: append to an existing CSV and continue the tracked runs of ``DIR/loggers.json``.
            upto_iteration: on resume, first drop the CSV's rows past that iteration (written after the
                checkpoint a run resumes from, and about to be written again).
            upto_env_steps: on resume, the env steps of that checkpoint: TensorBoard hides the points logged
                past them (its ``purge_step``), which the resumed run logs again.
            config: the run's config: the tracked run's project and hyper-parameters.

        Raises:
            ValueError: an unknown logger name (naming the nearest one).
            ImportError: the package of a named tracker is missing (naming the extra to install).
        """
        from orchestration.loggers import open_loggers

        names = tuple(loggers if loggers is not None else config.loggers if config is not None
                      else ("csv", "tensorboard"))
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.directory / "metrics.csv"
        self.loggers = open_loggers([n for n in names if tensorboard or n != "tensorboard"], self.directory,
                                    config=config, resume=resume, upto_iteration=upto_iteration,
                                    upto_env_steps=upto_env_steps)
        self._rows = 0

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records ``metrics`` at env step ``step`` (trackers: at ``metrics["iteration"]``, else the row count)."""
        self._rows += 1
        row = {k: float(v) for k, v in metrics.items()}
        iteration = int(row.get("iteration", self._rows))
        for logger in self.loggers:
            logger.write(step, iteration, row)

    def close(self) -> None:
        """Flushes and ends every logger (all of them, even when one fails; its error is raised after)."""
        errors = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as err:  # noqa: BLE001 -- raised below, once every logger had its chance
                errors.append(err)
        self.loggers = []
        if errors:
            raise errors[0]


def read_csv(path: str | Path) -> dict[str, list[float]]:
    """Columns of a metrics CSV as float lists (empty cells become NaN); a ValueError names a cell that is no number
    by its file, line and column."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    columns: dict[str, list[float]] = {k: [] for k in (rows[0] if rows else {})}
    for line, row in enumerate(rows, 2):  # line 1 is the header
        for key, values in columns.items():
            try:
                values.append(float(row[key]) if row[key] not in ("", None) else math.nan)
            except ValueError:
                raise ValueError(f"{path}, line {line}, column {key!r}: {row[key]!r} is not a number (was the "
                                 f"file edited?)") from None
    return columns


def plot_learning_curve(csv_path: str | Path, png_path: str | Path, *, y: str = "episode_return_mean",
                        title: str = "") -> Path | None:
    """Writes a PNG of ``y`` against env steps from a metrics CSV; returns its path (None without data)."""
    if not Path(csv_path).exists():  # no iteration ran (--iterations 0, or a resume of a finished run)
        return None
    data = read_csv(csv_path)
    if y not in data or not data[y]:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global figure state, and a shorter import at a run's end

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    ax.plot(data["env_steps"], data[y], label=y + " (last 100 episodes)")
    if "episode_return_mean_10" in data and y == "episode_return_mean":
        ax.plot(data["env_steps"], data["episode_return_mean_10"], label="last 10 episodes", alpha=0.5)
    if "eval_return_mean" in data and any(math.isfinite(v) for v in data["eval_return_mean"]):
        ax.plot(data["env_steps"], data["eval_return_mean"], label="eval_return_mean", linestyle="--")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    return Path(png_path)


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
        20: 2.09, 30: 2.04}


def _t95(dof: int) -> float:
    """Two-sided 95% Student-t quantile (table; 1.96 past 30 degrees of freedom)."""
    return next((v for k, v in sorted(_T95.items()) if dof <= k), 1.96)


def interquartile_mean(values: list[float]) -> float:
    """Mean of the middle 50% of ``values`` (rliable's IQM: robust to a few outlying seeds)."""
    import numpy as np

    x = np.sort(np.asarray(values, dtype=np.float64))
    n = len(x)
    if n == 0:
        return math.nan
    lo, hi = n * 0.25, n * 0.75  # fractional trimming, as scipy.stats.trim_mean with weights at the edges
    weights = np.clip(np.minimum(np.arange(1, n + 1), hi) - np.maximum(np.arange(n), lo), 0, 1)
    return float((x * weights).sum() / weights.sum())


def plot_runs(runs: list[str | Path], png_path: str | Path, *, y: str = "episode_return_mean",
              points: int = 200) -> dict:
    """Mean curve of ``y`` over several runs (seeds) against env steps, with a 95% t-interval, into a PNG.

    Each run's curve is interpolated onto a common grid of env steps where every run has values: from the
    latest first value to the earliest last one (a run never stands in with a value it did not reach yet, or
    any more). Returns the summary: runs, each run's value at the grid's last step (``final``, at
    ``final_env_steps``: where the drawn curve ends; ``last_env_steps``: where each run ends), their mean with
    its 95% interval, and their IQM. ``runs`` may also name a ``metrics.csv`` or a directory of runs (``seed_*``).

    Raises:
        ValueError: a run without ``metrics.csv``, without column ``y`` or without any value in it (named), or
            runs whose values share no env steps.
    """
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("name the run directories to draw, e.g. runs/A runs/B")
    runs = [r for run in runs for r in _run_dirs(Path(run))]
    twice = sorted({str(r) for r in runs if sum(r.resolve() == o.resolve() for o in runs) > 1})
    if twice:  # counted twice, a run would narrow the interval and move the IQM
        raise ValueError(f"{', '.join(twice)} named twice (as a directory, its metrics.csv or a run under a directory "
                         f"named too): name each run once")
    envs = {str(run): _env_of(run) for run in runs}
    if len(set(envs.values()) - {None}) > 1:  # the mean and IQM of two tasks' returns mean nothing
        raise ValueError(f"the runs are of different envs ({', '.join(f'{r}: {e}' for r, e in envs.items() if e)}); "
                         f"shoal plot draws the seeds of one setup: plot each env's runs apart")
    if differ := _settings_that_differ(runs):  # one curve of two setups (MAPPO and IPPO) would look like one
        raise ValueError(f"the runs differ in {differ}; shoal plot draws the seeds of one setup as one curve: plot "
                         f"each setup's runs apart and compare the figures and their finals")
    curves = []
    for run in runs:
        path = Path(run) / "metrics.csv"
        data = read_csv(path)
        if y not in data:
            from core.envsets.ids import hint

            raise ValueError(f"{path} has no column {y!r}{hint(y, sorted(data), rest_as='it has {}')}")
        xs, ys = np.asarray(data["env_steps"]), np.asarray(data[y])
        keep = np.isfinite(ys)
        if not keep.any():
            raise ValueError(f"{run} has no value of {y!r} yet (every row of its column is empty: no episode ended?); "
                             f"leave it out, or draw another --metric")
        curves.append((xs[keep], ys[keep]))
    start, end = max(float(xs[0]) for xs, _ in curves), min(float(xs[-1]) for xs, _ in curves)
    if start > end:
        raise ValueError(f"the runs' values of {y!r} share no env steps (one ends at {end:g}, another starts at "
                         f"{start:g}): draw runs of one length")
    grid = np.linspace(start, end, points)
    stacked = np.stack([np.interp(grid, xs, ys) for xs, ys in curves])  # [runs, points]
    n = len(curves)
    mean = stacked.mean(0)
    half = _t95(n - 1) * stacked.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros_like(mean)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(grid, mean, label=f"{y}: mean of {n} runs")
    ax.fill_between(grid, mean - half, mean + half, alpha=0.25, label="95% interval")
    ax.set_xlabel("env steps")
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    finals = [float(v) for v in stacked[:, -1]]  # at ``end``, where the drawn curve ends
    final_half = _t95(n - 1) * float(np.std(finals, ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return {"runs": [str(r) for r in runs], "metric": y, "final": finals, "final_env_steps": end,
            "last_env_steps": [float(xs[-1]) for xs, _ in curves],
            "final_mean": float(np.mean(finals)),
            "final_ci95": [float(np.mean(finals)) - final_half, float(np.mean(finals)) + final_half] if n > 1
            else None,  # one run has no interval (a zero-width one would claim certainty)
            "final_iqm": interquartile_mean(finals), "plot": str(png_path)}


#: ``config.json`` fields that may differ between the seeds of one setup (bookkeeping, not what is learnt;
#: ``anneal_iterations``: a resumed run writes the horizon it keeps, a fresh one 0 for the same schedule).
_BOOKKEEPING = ("seed", "run_dir", "iterations", "anneal_iterations", "checkpoint_every", "checkpoint_every_s",
                "keep_checkpoints", "loggers", "project", "mlflow_tracking_uri", "threads", "backend", "address", "ray",
                "device", "eval_every", "eval_episodes", "external")


def _settings_that_differ(runs: list[Path]) -> str:
    """The first settings (at most 3) whose values differ between runs' ``config.json`` files, worded with two
    runs' values ("" when none differ or fewer than two runs have a readable config)."""
    def flat(value, prefix=""):
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): value}

    configs = {str(run): {k: v for k, v in flat(config).items() if k.split(".")[0] not in _BOOKKEEPING}
               for run in runs if (config := _config_of(run)) is not None}
    if len(configs) < 2:
        return ""
    (first, a), rest = next(iter(configs.items())), list(configs.items())[1:]
    differ = []
    for key in sorted({k for c in configs.values() for k in c}):
        other = next(((r, c.get(key)) for r, c in rest if c.get(key) != a.get(key)), None)
        if other is not None:
            differ.append(f"{key} ({a.get(key)!r} in {first}, {other[1]!r} in {other[0]})")
    return "; ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")


def _config_of(run: Path) -> dict | None:
    """A run's ``config.json`` as a dict; None without a readable one."""
    try:
        config = json.loads((Path(run) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _env_of(run: Path) -> str | None:
    """The env (or collection) a run's ``config.json`` names; None without a readable one."""
    config = _config_of(run)
    return None if config is None else str(config.get("collection") or config.get("env"))


def _run_dirs(path: Path) -> list[Path]:
    """The run directories ``path`` names: itself, the directory of a ``metrics.csv`` it names, or the runs
    right under it (``seed_*`` of a ``--seeds`` run); a ValueError when none."""
    if path.name == "metrics.csv" and path.is_file():
        return [path.parent]
    if (path / "metrics.csv").is_file():
        return [path]
    inside = sorted(p for p in path.iterdir() if (p / "metrics.csv").is_file()) if path.is_dir() else []
    if inside:
        return inside
    raise ValueError(f"{path} has no metrics.csv, nor any run directory right under it (is it a run directory?)")


__all__ = ["MetricsLog", "interquartile_mean", "plot_learning_curve", "plot_runs", "read_csv"]
