"""The run's loggers: every iteration's metrics (evaluation included) reach W&B and MLflow at the iteration's
step, and the trackers are closed; an unknown logger name and a missing tracker package are named errors.

W&B and MLflow are replaced by small fakes in ``sys.modules``: what is checked is Shoal's side of the calls.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types

import pytest

from core.losses import PPOConfig
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.metrics_log import MetricsLog, read_csv


class _FakeWandbRun:
    def __init__(self, **kwargs) -> None:
        self.kwargs, self.id = kwargs, kwargs.get("id") or "wandb-run-1"
        self.logged: list[tuple[int, dict]] = []
        self.finished = False

    def log(self, data, step=None) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


def _fake_wandb() -> types.ModuleType:
    wandb = types.ModuleType("wandb")
    wandb.runs = []

    def init(**kwargs):
        wandb.runs.append(_FakeWandbRun(**kwargs))
        return wandb.runs[-1]

    wandb.init = init
    return wandb


def _fake_mlflow() -> types.ModuleType:
    mlflow = types.ModuleType("mlflow")
    mlflow.calls, mlflow.metrics, mlflow.params, mlflow.active = [], [], {}, None

    def start_run(run_id=None, run_name=None):
        mlflow.calls.append(("start_run", run_id, run_name))
        mlflow.active = run_id or "mlflow-run-1"
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=mlflow.active))

    def end_run():
        mlflow.calls.append(("end_run",))
        mlflow.active = None

    mlflow.set_tracking_uri = lambda uri: mlflow.calls.append(("set_tracking_uri", uri))
    mlflow.set_experiment = lambda name: mlflow.calls.append(("set_experiment", name))
    mlflow.start_run, mlflow.end_run = start_run, end_run
    mlflow.log_params = lambda params: mlflow.params.update(params)
    mlflow.log_metrics = lambda metrics, step=None: mlflow.metrics.append((step, dict(metrics)))
    return mlflow


@pytest.fixture
def trackers(monkeypatch):
    wandb, mlflow = _fake_wandb(), _fake_mlflow()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    return wandb, mlflow


TINY = TrainConfig(env="builtin:cartpole", iterations=2, eval_every=2, eval_episodes=1,
                   rollout=RolloutConfig(num_envs=4, fragment_length=16), ppo=PPOConfig(minibatch_size=32, num_epochs=1))


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])])
def test_a_run_sends_every_iteration_to_wandb_and_mlflow_and_closes_them(tmp_path, trackers, backend, request):
    from orchestration.builder import build_trainer
    from orchestration.config import ExternalConfig, RayConfig
    from orchestration.run_loop import run_training

    wandb, mlflow = trackers
    if backend == "ray":  # the trackers are the driver's, whatever the backend
        request.getfixturevalue("ray_session")
    config = dataclasses.replace(TINY, run_dir=str(tmp_path / "run"), loggers=("csv", "wandb", "mlflow"),
                                 project="proj", mlflow_tracking_uri="sqlite:///x.db", backend=backend,
                                 ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0),
                                 external=ExternalConfig(token="s3cret"))  # a secret never sent to a tracker
    run_training(build_trainer(config), config, resume=False, progress=False)

    rows = read_csv(tmp_path / "run" / "metrics.csv")
    expected = [{k: v[i] for k, v in rows.items() if math.isfinite(v[i])} for i in range(2)]  # env_steps too
    assert "eval_return_mean" in expected[1] and "eval_return_mean" not in expected[0]  # evaluation at iteration 2
    assert ("pipeline/fragments" in expected[0]) == (backend == "ray")  # the Ray workers' pipeline report too
    assert rows["lr"] == [TINY.lr, TINY.lr / 2]  # the annealed learning rate each iteration trained with
    header, *lines = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    at = header.split(",").index("iteration")
    assert [line.split(",")[at] for line in lines] == ["1", "2"]  # counts written as whole numbers, not 1.0
    (run,) = wandb.runs
    assert run.kwargs["project"] == "proj" and run.kwargs["name"] == "run" and run.kwargs["config"]["seed"] == 0
    assert [step for step, _ in run.logged] == [1, 2] and run.finished
    for (_, logged), want in zip(run.logged, expected):
        assert logged == pytest.approx(want)
    assert [step for step, _ in mlflow.metrics] == [1, 2]
    for (_, logged), want in zip(mlflow.metrics, expected):
        assert logged == pytest.approx(want)
    assert mlflow.calls[:3] == [("set_tracking_uri", "sqlite:///x.db"), ("set_experiment", "proj"),
                                ("start_run", None, "run")]
    assert mlflow.calls[-1] == ("end_run",) and mlflow.active is None
    assert mlflow.params["rollout.num_envs"] == "4" and mlflow.params["loggers"] == "('csv', 'wandb', 'mlflow')"
    assert mlflow.params["external.token"] == "" and run.kwargs["config"]["external"]["token"] == ""
    assert not (tmp_path / "run" / "tensorboard").exists()  # not named: not written
    assert json.loads((tmp_path / "run" / "loggers.json").read_text()) == {"wandb": "wandb-run-1",
                                                                             "mlflow": "mlflow-run-1"}


def test_a_resumed_log_continues_the_tracked_runs_and_a_fresh_one_starts_new_ones(tmp_path, trackers):
    wandb, mlflow = trackers
    (tmp_path / "loggers.json").write_text(json.dumps({"wandb": "w-7", "mlflow": "m-7"}))
    MetricsLog(tmp_path, loggers=("wandb", "mlflow"), resume=True).close()
    assert wandb.runs[-1].kwargs["id"] == "w-7" and ("start_run", "m-7", None) in mlflow.calls
    MetricsLog(tmp_path, loggers=("wandb", "mlflow")).close()
    assert wandb.runs[-1].kwargs["id"] is None and mlflow.calls[-2] == ("start_run", None, tmp_path.name)


def test_an_unknown_logger_is_named_with_the_nearest_one(tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    with pytest.raises(ValueError, match="unknown logger 'wandbb' \\(did you mean 'wandb'\\?\\)"):
        TrainConfig(loggers=("csv", "wandbb"))
    assert TrainConfig(loggers="csv").loggers == ("csv",)  # a config file's single name
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "builtin:cartpole", "--loggers", "csv", "tensorbord", "--no-progress"])
    err = capsys.readouterr().err
    words = " ".join(err.split())
    assert exit_.value.code == 2 and "unknown logger 'tensorbord' (did you mean 'tensorboard'?)" in words, err


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_missing_tracker_package_names_the_extra_to_install(tmp_path, monkeypatch, capsys, package):
    from orchestration.cli import main

    monkeypatch.setitem(sys.modules, package, None)  # makes the import fail as if not installed
    with pytest.raises(ImportError, match=f"pip install 'shoal\\[{package}\\]'"):
        MetricsLog(tmp_path / "direct", loggers=("csv", package))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "builtin:cartpole", "--iterations", "1", "--loggers", "csv", package, "--no-progress",
              "--run-dir", "run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"pip install 'shoal[{package}]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1  # one paragraph
