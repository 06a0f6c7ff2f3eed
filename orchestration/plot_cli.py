"""``shoal plot``: several runs (seeds) drawn together, with their final values (:func:`plot`)."""

from __future__ import annotations

import sys

import tyro

from orchestration.result_line import print_result


def plot(runs: tyro.conf.Positional[list[str]], out: str = "runs.png", metric: str = "episode_return_mean") -> dict:
    """Draws ``metric`` against env steps for several runs (seeds): their mean and 95% interval, into ``out``;
    prints the final values, their mean with its 95% interval (None for one run) and their interquartile mean (IQM).

    Args:
        runs: run directories (or their ``metrics.csv``, or a directory of runs such as ``--seeds`` makes).
        out: the PNG to write.
        metric: the ``metrics.csv`` column to draw (e.g. ``eval_return_mean``).
    """
    from orchestration.metrics_log import plot_runs

    summary = plot_runs(runs, out, y=metric)
    print_result(summary)
    if len(set(summary["last_env_steps"])) > 1:
        print(f"shoal plot: the runs end at different env steps ({min(summary['last_env_steps']):g} to "
              f"{max(summary['last_env_steps']):g}); the curve and the finals stop at {summary['final_env_steps']:g}, "
              f"where every run has values", file=sys.stderr)
    return summary


__all__ = ["plot"]
