"""Where metrics go: a CSV file, TensorBoard event files, and a learning-curve PNG at the end.

The only effectful sink of training metrics; everything upstream returns plain dicts of numbers.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Mapping


class MetricsLog:
    """Appends one row of scalar metrics per iteration to ``DIR/metrics.csv`` and TensorBoard.

    A key that appears later (evaluation metrics every N iterations, a win rate once a game ends) adds a
    column: the file is rewritten once with the wider header (earlier rows get empty cells), so the header
    always describes every row and nothing is dropped.
    """

    def __init__(self, directory: str | Path, *, tensorboard: bool = True, resume: bool = False,
                 upto_iteration: int | None = None) -> None:
        """``resume``: append to an existing CSV; ``upto_iteration``: first drop its rows past that iteration
        (written after the checkpoint a run resumes from, and about to be written again)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.directory / "metrics.csv"
        self._columns: list[str] | None = None
        if resume and self.csv_path.exists():
            with open(self.csv_path, newline="") as f:
                rows = list(csv.reader(f))
            self._columns = rows[0] if rows else None
            if upto_iteration is not None and self._columns and "iteration" in self._columns:
                at = self._columns.index("iteration")
                kept = [r for r in rows[1:] if len(r) > at and r[at] and float(r[at]) <= upto_iteration]
                tmp = self.csv_path.with_suffix(".csv.tmp")
                with open(tmp, "w", newline="") as f:
                    csv.writer(f).writerows([self._columns, *kept])
                tmp.replace(self.csv_path)
        elif self.csv_path.exists():
            self.csv_path.unlink()
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory / "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records ``metrics`` at env step ``step``."""
        row = {"env_steps": step, **{k: float(v) for k, v in metrics.items()}}
        if self._columns is None:
            self._columns = list(row)
            with open(self.csv_path, "w", newline="") as f:
                csv.writer(f).writerow(self._columns)
        elif new := [k for k in row if k not in self._columns]:
            self._widen(new)
        with open(self.csv_path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self._columns])
        if self._writer is not None:
            for k, v in row.items():
                if k != "env_steps" and math.isfinite(v):
                    self._writer.add_scalar(k, v, step)
            self._writer.flush()

    def _widen(self, new: list[str]) -> None:
        """Rewrites the CSV with ``new`` columns appended to the header (atomically: write, then rename)."""
        with open(self.csv_path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        self._columns = [*self._columns, *new]
        tmp = self.csv_path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self._columns)
            writer.writerows(r + [""] * (len(self._columns) - len(r)) for r in rows)
        tmp.replace(self.csv_path)

    def close(self) -> None:
        """Flushes TensorBoard."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_csv(path: str | Path) -> dict[str, list[float]]:
    """Columns of a metrics CSV as float lists (empty cells become NaN)."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) if r[k] not in ("", None) else math.nan for r in rows] for k in (rows[0] if rows else {})}


def plot_learning_curve(csv_path: str | Path, png_path: str | Path, *, y: str = "episode_return_mean",
                        title: str = "") -> Path | None:
    """Writes a PNG of ``y`` against env steps from a metrics CSV; returns its path (None without data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not Path(csv_path).exists():  # no iteration ran (--iterations 0, or a resume of a finished run)
        return None
    data = read_csv(csv_path)
    if y not in data or not data[y]:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
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
    plt.close(fig)
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

    Each run's curve is interpolated onto a common grid of env steps (up to the shortest run's last step).
    Returns the summary: runs, final values, their mean with its 95% interval, and their IQM.

    Raises:
        ValueError: a run without ``metrics.csv`` or without column ``y`` (named).
    """
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = []
    for run in runs:
        path = Path(run) / "metrics.csv"
        if not path.exists():
            raise ValueError(f"shoal plot: {run} has no metrics.csv (is it a run directory?)")
        data = read_csv(path)
        if y not in data:
            raise ValueError(f"shoal plot: {path} has no column {y!r}; it has {sorted(data)}")
        xs, ys = np.asarray(data["env_steps"]), np.asarray(data[y])
        keep = np.isfinite(ys)
        curves.append((xs[keep], ys[keep]))
    end = min(float(xs[-1]) for xs, _ in curves if len(xs))
    grid = np.linspace(min(float(xs[0]) for xs, _ in curves), end, points)
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
    finals = [float(ys[-1]) for _, ys in curves]
    final_half = _t95(n - 1) * float(np.std(finals, ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return {"runs": [str(r) for r in runs], "metric": y, "final": finals, "final_mean": float(np.mean(finals)),
            "final_ci95": [float(np.mean(finals)) - final_half, float(np.mean(finals)) + final_half],
            "final_iqm": interquartile_mean(finals), "plot": str(png_path)}


__all__ = ["MetricsLog", "interquartile_mean", "plot_learning_curve", "plot_runs", "read_csv"]
