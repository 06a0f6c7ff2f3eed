"""The sinks of training metrics behind one interface: ``metrics.csv``, TensorBoard, Weights & Biases, MLflow.

Each sink is a :class:`Logger` that receives one row of scalars per iteration and is closed at the end of
the run; :class:`orchestration.metrics_log.MetricsLog` opens the ones ``TrainConfig.loggers`` names and fans
every row out to them::

    loggers = open_loggers(("csv", "wandb"), run_dir, config=config, resume=False)
    for metrics in rows:                                    # one per iteration, evaluation metrics included
        for logger in loggers:
            logger.write(env_steps, iteration, metrics)
    for logger in loggers:
        logger.close()

The x-axis: env steps for the CSV and TensorBoard (as Shoal always wrote them), the iteration for W&B and
MLflow (whose step must grow by one row per call). W&B and MLflow are optional extras (``pip install
'shoal[wandb]'``, ``'shoal[mlflow]'``), imported only when named. Their run ids are kept in
``RUN_DIR/loggers.json``, so that ``shoal train --resume`` continues the same tracked run.

TorchRL's loggers (``torchrl.record.loggers``) were considered and not used: its CSVLogger writes one file
per scalar (not ``metrics.csv``), its WandbLogger adds a step key per metric group and records every
installed package, and its MLFlowLogger's ``close`` leaves the MLflow run open.
"""

from __future__ import annotations

import csv
import difflib
import importlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from orchestration.config import TrainConfig

LOGGER_NAMES = ("csv", "tensorboard", "wandb", "mlflow")
"""The values ``TrainConfig.loggers`` accepts."""


class Logger(Protocol):
    """One sink of per-iteration scalar metrics (evaluation metrics arrive in the row of their iteration)."""

    def write(self, env_steps: int, iteration: int, metrics: Mapping[str, float]) -> None:
        """Records one row of metrics (floats, possibly NaN) of iteration ``iteration``."""

    def close(self) -> None:
        """Flushes and ends the sink; called once, also when training failed."""


def check_logger_names(names: Sequence[str]) -> None:
    """Refuses an unknown or repeated logger name, naming it and its nearest valid spelling.

    Raises:
        ValueError: the offending name.
    """
    for name in names:
        if name not in LOGGER_NAMES:
            near = difflib.get_close_matches(name, LOGGER_NAMES, n=1, cutoff=0.4)
            raise ValueError(f"unknown logger {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; the loggers are {', '.join(LOGGER_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"loggers named twice: {list(names)}")


def open_loggers(names: Sequence[str], directory: str | Path, *, config: TrainConfig | None = None,
                 resume: bool = False, upto_iteration: int | None = None,
                 upto_env_steps: int | None = None) -> list[Logger]:
    """The loggers ``names`` lists, writing under ``directory`` (``config`` gives the tracked run's project,
    name and hyper-parameters). On an error, the loggers opened so far are closed again.

    Raises:
        ValueError: an unknown logger name.
        ImportError: a tracker's package is missing (one paragraph naming the extra to install).
    """
    check_logger_names(names)
    directory = Path(directory)
    ids = _RunIds(directory, resume)
    opened: list[Logger] = []
    try:
        for name in names:
            if name == "csv":
                opened.append(CsvLogger(directory, resume=resume, upto_iteration=upto_iteration))
            elif name == "tensorboard":
                opened.append(TensorboardLogger(directory, upto_env_steps if resume else None))
            elif name == "wandb":
                opened.append(WandbLogger(directory, config, ids))
            else:
                opened.append(MlflowLogger(directory, config, ids))
    except BaseException:
        for logger in opened:
            logger.close()
        raise
    return opened


class CsvLogger:
    """Appends one row per iteration to ``DIR/metrics.csv`` (first column ``env_steps``).

    A key that appears later (evaluation metrics every N iterations, a win rate once a game ends) adds a
    column: the file is rewritten once with the wider header (earlier rows get empty cells), so the header
    always describes every row and nothing is dropped.
    """

    def __init__(self, directory: Path, *, resume: bool = False, upto_iteration: int | None = None) -> None:
        """``resume``: append to an existing CSV; ``upto_iteration``: first drop its rows past that iteration
        (written after the checkpoint a run resumes from, and about to be written again)."""
        self.path = directory / "metrics.csv"
        self._columns: list[str] | None = None
        if resume and self.path.exists():
            with open(self.path, newline="") as f:
                rows = list(csv.reader(f))
            self._columns = rows[0] if rows else None
            if upto_iteration is not None and self._columns and "iteration" in self._columns:
                at = self._columns.index("iteration")
                kept = [r for r in rows[1:] if len(r) > at and r[at] and float(r[at]) <= upto_iteration]
                self._rewrite([self._columns, *kept])
        elif self.path.exists():
            self.path.unlink()

    def write(self, env_steps: int, iteration: int, metrics: Mapping[str, float]) -> None:
        row = {"env_steps": env_steps, **metrics}
        if self._columns is None:
            self._columns = list(row)
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self._columns)
        elif new := [k for k in row if k not in self._columns]:
            with open(self.path, newline="") as f:
                rows = list(csv.reader(f))[1:]
            self._columns = [*self._columns, *new]
            self._rewrite([self._columns, *(r + [""] * (len(self._columns) - len(r)) for r in rows)])
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_cell(row.get(c, "")) for c in self._columns])

    def _rewrite(self, rows) -> None:
        """Replaces the CSV atomically (write, then rename): a kill leaves the old file or the new one."""
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(rows)
        tmp.replace(self.path)

    def close(self) -> None:
        pass  # every row is on disk once written


def _cell(value):
    """A whole number as one (iterations, counts: ``3``, not ``3.0``); any other value as it is."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    return value


class TensorboardLogger:
    """TensorBoard event files in ``DIR/tensorboard``, against env steps; non-finite values are left out.

    ``upto_env_steps`` (a resumed run: its checkpoint's env steps): the points an interrupted run logged after
    its checkpoint are hidden (TensorBoard's ``purge_step``), so the iterations the resumed run trains again
    appear once, as in ``metrics.csv``."""

    def __init__(self, directory: Path, upto_env_steps: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if upto_env_steps is None else upto_env_steps + 1  # points at or past it are hidden
        self._writer = SummaryWriter(str(directory / "tensorboard"), purge_step=purge)

    def write(self, env_steps: int, iteration: int, metrics: Mapping[str, float]) -> None:
        for k, v in _finite(metrics).items():
            if k != "env_steps":
                self._writer.add_scalar(k, v, env_steps)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run (project ``TrainConfig.project``, named after the run directory, the config as
    its hyper-parameters), one ``log`` per iteration at step ``iteration``. Offline: ``WANDB_MODE=offline``.

    On resume W&B keeps the rows it already has: it ignores steps up to its last one (those the resumed run
    repeats after its checkpoint)."""

    def __init__(self, directory: Path, config: TrainConfig | None, ids: _RunIds) -> None:
        from orchestration.run_state import secret_free  # the config without its secrets

        wandb = _require("wandb")
        self._run = wandb.init(project=_project(config), name=_run_name(directory), dir=str(directory),
                               config=secret_free(config) if config else None, id=ids.get("wandb"),
                               resume="allow")
        ids.put("wandb", self._run.id)

    def write(self, env_steps: int, iteration: int, metrics: Mapping[str, float]) -> None:
        self._run.log(_finite(metrics), step=iteration)

    def close(self) -> None:
        self._run.finish()


class MlflowLogger:
    """An MLflow run (experiment ``TrainConfig.project``, tracking server ``TrainConfig.mlflow_tracking_uri``,
    named after the run directory, the flattened config as its parameters), metrics at step ``iteration``."""

    def __init__(self, directory: Path, config: TrainConfig | None, ids: _RunIds) -> None:
        mlflow = self._mlflow = _require("mlflow")
        if config is not None and config.mlflow_tracking_uri:
            mlflow.set_tracking_uri(config.mlflow_tracking_uri)
        mlflow.set_experiment(_project(config))
        run_id = ids.get("mlflow")
        run = mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(run_name=_run_name(directory))
        self.run_id = run.info.run_id
        ids.put("mlflow", self.run_id)
        if config is not None and not run_id:  # parameters are write-once in MLflow
            from orchestration.run_state import secret_free  # the config without its secrets

            params = sorted(_flatten(secret_free(config)).items())
            for at in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
                mlflow.log_params(dict(params[at:at + 100]))

    def write(self, env_steps: int, iteration: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(_finite(metrics), step=iteration)

    def close(self) -> None:
        self._mlflow.end_run()


_EXTRAS = {"wandb": "Weights & Biases", "mlflow": "MLflow"}


def _require(package: str):
    """Imports a tracker's package, or raises one paragraph naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"logger {package!r} needs the {package} package ({_EXTRAS[package]}), which could not be imported "
            f"({err}); install it with: pip install 'shoal[{package}]' (or leave {package!r} out of --loggers)"
        ) from err


class _RunIds:
    """The tracked runs' ids in ``DIR/loggers.json``: kept on resume, forgotten by a fresh run."""

    def __init__(self, directory: Path, resume: bool) -> None:
        self.path = directory / "loggers.json"
        self.ids: dict[str, str] = json.loads(self.path.read_text()) if resume and self.path.exists() else {}

    def get(self, name: str) -> str | None:
        return self.ids.get(name)

    def put(self, name: str, run_id: str) -> None:
        self.ids[name] = run_id
        self.path.write_text(json.dumps(self.ids, indent=1))


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def _project(config: TrainConfig | None) -> str:
    return config.project if config is not None else "shoal"


def _run_name(directory: Path) -> str:
    """The run directory's name; a ``--seeds`` run (``BASE/seed_K``) is called ``BASE/seed_K``."""
    directory = directory.resolve()
    return f"{directory.parent.name}/{directory.name}" if directory.name.startswith("seed_") else directory.name


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


__all__ = ["LOGGER_NAMES", "CsvLogger", "Logger", "MlflowLogger", "TensorboardLogger", "WandbLogger",
           "check_logger_names", "open_loggers"]
