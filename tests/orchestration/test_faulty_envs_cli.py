"""Faulty envs from the ``shoal`` command: a hang, a crash, a raise or a wrong shape restarts the env process in
lenient mode (each fault counted once, the run finishes) and stops a strict run with a named error and a
checkpoint of the iterations before it."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest

from orchestration import checkpoint as ckpt
from tests.orchestration.test_crash_safety import _shoal


FAULTY = "tests.orchestration.faulty_env_factories:make_faulty"  # fails at its 40th step: see that module
ROOT = Path(__file__).resolve().parents[2]


def _faulty_env(tmp_path) -> tuple[list[str], dict]:
    """The ``--env-kwargs`` marker of a run's faults (a file per fault, beside ``tmp_path/fault-happened``) and
    the environment variables a ``shoal`` run needs to import the faulty env from the tests package."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return ["marker", str(tmp_path / "fault-happened")], env


@pytest.mark.slow
def test_faulty_envs_from_the_cli_are_restarted_counted_and_the_run_finishes(tmp_path):
    """One run meets a hang, a crash, a raise and a wrong shape (two at step 40, two at step 40 of the restarted
    envs): each fault restarts its process, and each is counted once, under its own counter."""
    run, (marker, env) = tmp_path / "run", _faulty_env(tmp_path)
    _shoal("train", FAULTY, "--env-kwargs", "fault", "hang,crash,raise,shape", *marker,
           "--rollout.num-envs", "4", "--rollout.fragment-length", "32", "--rollout.env-processes", "2",
           "--rollout.env-timeout-s", "2", "--rollout.check", "lenient", "--iterations", "4", "--no-progress",
           "--run-dir", str(run), cwd=tmp_path, env=env)
    with open(run / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert all((tmp_path / f"fault-happened-{fault}").exists() for fault in ("hang", "crash", "raise", "shape"))
    counts = {k: float(last[f"env/{k}"]) for k in ("step_timeouts", "worker_crashes", "worker_errors",
                                                   "env_restarts", "episodes_lost")}
    assert counts == {"step_timeouts": 1, "worker_crashes": 1, "worker_errors": 2, "env_restarts": 4,
                      "episodes_lost": 8}  # two envs lost with each restarted process
    assert int(float(last["iteration"])) == 4


@pytest.mark.slow
def test_lenient_mode_alone_restarts_an_env_that_raises_or_returns_a_wrong_shape(tmp_path):
    """No process or timeout flag: lenient mode keeps the envs in a subprocess by itself."""
    run, (marker, env) = tmp_path / "run", _faulty_env(tmp_path)
    _shoal("train", FAULTY, "--env-kwargs", "fault", "shape,raise", *marker, "--rollout.num-envs", "2",
           "--rollout.fragment-length", "32", "--rollout.check", "lenient", "--iterations", "3", "--no-progress",
           "--run-dir", str(run), cwd=tmp_path, env=env)
    with open(run / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["env/worker_errors"]) == 2 and float(last["env/episodes_lost"]) == 4


@pytest.mark.slow
def test_in_strict_mode_a_faulty_env_stops_the_run_with_a_named_error_and_a_checkpoint(tmp_path):
    run, (marker, env) = tmp_path / "run", _faulty_env(tmp_path)
    out = _shoal("train", FAULTY, "--env-kwargs", "fault", "raise", *marker, "--rollout.num-envs", "4",
                 "--rollout.fragment-length", "32", "--rollout.env-processes", "2", "--iterations", "3",
                 "--no-progress", "--run-dir", str(run), cwd=tmp_path, env=env, check=False)
    assert out.returncode != 0
    assert re.search(r"env worker \d \(envs \d\.\.\d of the batch\) raised RuntimeError: the simulator raised",
                     out.stderr), out.stderr[-2000:]
    assert ckpt.load_checkpoint(run / "checkpoints")[2]["iteration"] == 1  # the iteration before the fault survives


@pytest.mark.ray
@pytest.mark.slow
def test_faulty_envs_in_ray_workers_are_restarted_and_counted_as_locally(ray_session, tmp_path):
    """The run of ``test_faulty_envs_from_the_cli_are_restarted_counted_and_the_run_finishes`` on the Ray backend:
    the env processes live in a rollout worker, which restarts them; the driver's metrics count each fault once."""
    from orchestration.builder import build_trainer
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig

    config = TrainConfig(env=FAULTY, backend="ray", iterations=4,
                         env_kwargs=(("fault", "hang,crash,raise,shape"), ("marker", str(tmp_path / "fault"))),
                         rollout=RolloutConfig(num_envs=4, fragment_length=32, env_processes=2, env_timeout_s=2.0,
                                               check="lenient"),
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0))
    trainer = build_trainer(config)
    try:
        for _ in range(4):
            metrics = trainer.train()
    finally:
        trainer.close()
    assert all((tmp_path / f"fault-{fault}").exists() for fault in ("hang", "crash", "raise", "shape"))
    counts = {k: metrics[f"env/{k}"] for k in ("step_timeouts", "worker_crashes", "worker_errors", "env_restarts",
                                               "episodes_lost")}
    assert counts == {"step_timeouts": 1, "worker_crashes": 1, "worker_errors": 2, "env_restarts": 4,
                      "episodes_lost": 8}
    assert metrics["workers_restarted"] == 0  # the rollout worker restarted its env processes, not Ray it


def test_ctrl_c_to_the_whole_process_group_stops_a_run_with_env_processes_cleanly(tmp_path):
    """A terminal's Ctrl-C reaches the env processes too (one process group): the run still stops after its
    iteration with one line, exit 130 and a checkpoint to resume (workers killed by it read as an env fault:
    strict mode ended in a traceback). mpe2's slow steps: most of an iteration is stepping, so the signal lands
    there (an iteration of CartPole is mostly its update, and passed without the fix)."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "train", "mpe2:simple_spread_v3",
                                "--rollout.num-envs", "8", "--rollout.fragment-length", "32", "--rollout.env-processes",
                                "2", "--iterations", "100000", "--no-progress", "--run-dir", str(run)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group: ours
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.csv").exists() or len((run / "metrics.csv").read_text().splitlines()) < 3:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130 and "shoal train: stopped by SIGINT after iteration" in err, err[-3000:]
    assert "Traceback" not in err and "EnvWorkerFault" not in err, err[-3000:]
    assert list((run / "checkpoints").iterdir())


def test_a_device_word_that_torch_does_not_parse_is_refused_only_for_envs_that_take_a_torch_device():
    """Every env's ``device`` keyword was parsed as a torch device: a user factory's own word for one ("auto")
    was refused as no device."""
    from orchestration.env_parameters import check_values

    with pytest.raises(ValueError, match=r"env 'builtin:cartpole': --env-kwargs device 'cpux': not a device"):
        check_values("builtin:cartpole", {"device": "cpux"})
    check_values("tests.orchestration.faulty_env_factories:make_device_env", {"device": "auto"})  # its own word
    with pytest.raises(ValueError, match="no such CUDA device here"):  # a torch device this machine lacks: said
        check_values("tests.orchestration.faulty_env_factories:make_device_env", {"device": "cuda:7"})


def test_make_env_names_an_env_count_below_one():
    """``make_env(..., num_envs=0)`` failed inside gymnasium with an IndexError."""
    from orchestration.envs import make_env

    with pytest.raises(ValueError, match=r"env 'CartPole-v1': num_envs must be an int >= 1, got 0"):
        make_env("CartPole-v1", 0)
