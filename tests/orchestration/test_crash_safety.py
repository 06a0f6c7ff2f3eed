"""Nothing lost: atomic checkpoints under kills, interrupted and failing runs leave a checkpoint that resumes,
metrics match the checkpoint, non-finite training stops (untrusted checkpoints: test_untrusted_checkpoints)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from orchestration import checkpoint as ckpt
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.learner import NonFiniteTraining
from orchestration.run_state import trainer_state

ARGS = ["builtin:cartpole", "--rollout.num-envs", "8", "--rollout.fragment-length", "32", "--seed", "3",
        "--no-progress", "--checkpoint-every-s", "0"]
FAST = TrainConfig(env="builtin:cartpole", iterations=4, rollout=RolloutConfig(num_envs=8, fragment_length=32))


def _parts(trainer) -> dict:
    weights, tensors, state = trainer_state(trainer)
    return {"weights": weights, "tensors": tensors, "state": state}


def _shoal(*args: str, cwd, check: bool = True, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "orchestration.cli", *args], cwd=cwd, capture_output=True,
                            text=True, timeout=300, env=env)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _iterations(path: Path) -> list[int]:
    with open(path) as f:
        return [int(float(r["iteration"])) for r in csv.DictReader(f)]


# -- atomic writes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_kill_at_any_point_of_resaving_a_step_leaves_a_complete_checkpoint(tmp_path, monkeypatch, fail_at):
    trainer = build_trainer(FAST)
    trainer.train()
    first = ckpt.save_checkpoint(tmp_path, 1, **_parts(trainer))
    trainer.train()
    calls = {"n": 0}
    real = os.replace

    def dying_replace(a, b):  # the process dies at the fail_at-th rename: nothing after it happens
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise KeyboardInterrupt("killed")
        return real(a, b)

    monkeypatch.setattr(ckpt.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 1, **_parts(trainer))  # the same step again (the CLI's final save)
        raise KeyboardInterrupt  # fail_at past the last rename: completed, count it as the kill after
    monkeypatch.setattr(ckpt.os, "replace", real)
    weights, _, state = ckpt.load_checkpoint(tmp_path)  # always a complete checkpoint
    assert state["iteration"] in (1, 2)
    assert first.exists() or ckpt.resolve(tmp_path) != first


def test_stale_temporaries_are_cleaned_and_a_missing_pointer_falls_back_to_the_newest(tmp_path):
    trainer = build_trainer(FAST)
    trainer.train()
    ckpt.save_checkpoint(tmp_path, 1, **_parts(trainer))
    trainer.train()
    newest = ckpt.save_checkpoint(tmp_path, 2, **_parts(trainer))
    (tmp_path / ".tmp-dead").mkdir()
    (tmp_path / ".tmp-dead" / "weights.safetensors").write_bytes(b"half")
    assert ckpt.clean_stale(tmp_path) == 1 and not (tmp_path / ".tmp-dead").exists()
    (tmp_path / "latest").unlink()
    with pytest.warns(RuntimeWarning, match="newest complete checkpoint"):
        assert ckpt.resolve(tmp_path) == newest
    (newest / "state.json").unlink()  # incomplete: the previous one is used
    (tmp_path / "latest").write_text(newest.name)
    with pytest.warns(RuntimeWarning):
        assert ckpt.resolve(tmp_path).name == "ckpt-000001"
    (tmp_path / "ckpt-000001" / "weights.safetensors").unlink()  # none complete: what the newest lacks is named
    with pytest.raises(FileNotFoundError, match=r"its newest, ckpt-000002, lacks state\.json \(a write cut short"):
        ckpt.resolve(tmp_path)


# -- interrupted and failing runs ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_sigint_ends_the_run_with_a_checkpoint_that_resumes(tmp_path, backend):
    """Ctrl-C: exit 130, the line that continues the run, a checkpoint of the last finished iteration. On Ray
    too (its own instance: ``ray.init`` installs signal handlers of its own); the resume itself is the same
    checkpoint, resumed on Ray in test_cli, so it runs here on the local backend only."""
    run = tmp_path / "run"
    ray = ["--backend", "ray", "--ray.num-cpus", "2", "--rollout.num-workers", "1"] if backend == "ray" else []
    proc = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "train", *ARGS, *ray, "--iterations",
                             "100000", "--run-dir", str(run)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    csv_path = run / "metrics.csv"
    deadline = time.monotonic() + 120
    while (not csv_path.exists() or len(_iterations(csv_path)) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and "continue with: shoal train --resume" in err, err[-2000:]
    state = ckpt.load_checkpoint(run / "checkpoints")[2]
    assert state["iteration"] == _iterations(csv_path)[-1] >= 2
    if backend == "ray":
        return
    _shoal("train", "--resume", "--run-dir", str(run), "--iterations", str(state["iteration"] + 1), "--no-progress",
           cwd=tmp_path)
    assert _iterations(csv_path) == list(range(1, state["iteration"] + 2))


RAISING_ENV = textwrap.dedent("""
    import gymnasium as gym
    from gymnasium.envs.classic_control import CartPoleEnv

    class RaisingCartPole(CartPoleEnv):
        steps = 0
        def step(self, action):
            RaisingCartPole.steps += 1
            if RaisingCartPole.steps > 8 * 32 * 3:
                raise RuntimeError("the simulator crashed")
            return super().step(action)

    gym.register("RaisingCartPole-v0", entry_point=RaisingCartPole, max_episode_steps=500)
""")


@pytest.mark.slow
def test_an_env_exception_leaves_a_checkpoint_of_the_iterations_before_it(tmp_path):
    (tmp_path / "raising_env.py").write_text(RAISING_ENV)
    run = tmp_path / "run"
    args = ["train", "raising_env:RaisingCartPole-v0", "--rollout.num-envs", "1", "--rollout.fragment-length", "32",
            "--rollout.num-workers", "8", "--iterations", "10", "--no-progress", "--run-dir", str(run)]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = _shoal(*args, cwd=tmp_path, check=False, env=env)
    assert out.returncode != 0 and "the simulator crashed" in out.stderr
    state = ckpt.load_checkpoint(run / "checkpoints")[2]
    assert state["iteration"] == 3 == _iterations(run / "metrics.csv")[-1]


def test_metrics_rows_past_the_checkpoint_are_cut_on_resume(tmp_path, monkeypatch):
    import shutil

    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--iterations", "3", "--checkpoint-every", "2", "--run-dir", "run"])
    root = tmp_path / "run" / "checkpoints"
    for d in root.glob("ckpt-000003*"):  # the run died after writing row 3, before its checkpoint
        shutil.rmtree(d)
    (root / "latest").write_text("ckpt-000002")
    main(["train", "--resume", "--run-dir", "run", "--iterations", "4", "--no-progress"])
    assert _iterations(tmp_path / "run" / "metrics.csv") == [1, 2, 3, 4]


@pytest.mark.slow
def test_kill_9_at_50_random_points_then_resume_ends_with_the_uninterrupted_weights(tmp_path):
    """The chaos run: kill -9 at 50 random moments of short runs (checkpoint writes slowed so that some kills
    land inside them; ``chaos_runner`` forks every run from one pre-imported parent). After every kill the
    checkpoint ``latest`` resolves to loads; every run, resumed after its kills, writes each iteration once
    and ends with the weights of the uninterrupted run."""
    from safetensors.torch import load_file

    args = [*ARGS, "--iterations", "6", "--checkpoint-every", "1"]
    result = subprocess.run([sys.executable, "-m", "tests.orchestration.chaos_runner", str(tmp_path), "--kills",
                             "50", "--seed", "7", "--", *args], cwd=Path(__file__).parents[2], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failures"] == [] and report["bad_checkpoints"] == 0, report
    assert report["kills"] == 50 and report["kills_in_writes"] >= 10, report
    straight = load_file(str(ckpt.resolve(tmp_path / "straight/checkpoints") / "weights.safetensors"))
    runs = sorted(tmp_path.glob("chaos-*"))
    assert len(runs) == report["runs"] >= 1
    for run in runs:
        assert _iterations(run / "metrics.csv") == list(range(1, 7)), run.name  # every iteration once
        chaos = load_file(str(ckpt.resolve(run / "checkpoints") / "weights.safetensors"))
        assert straight.keys() == chaos.keys() and all(torch.equal(straight[k], chaos[k]) for k in straight), run


# -- schedules and non-finite training ---------------------------------------------------------------------------
def test_resume_with_more_iterations_keeps_the_learning_rate_schedule(tmp_path, monkeypatch, capsys):
    """In-process ``shoal`` calls (test_cli.py resumes in a new process)."""
    import shutil

    from safetensors.torch import load_file

    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--iterations", "4", "--run-dir", "a"])
    main(["train", *ARGS, "--iterations", "4", "--checkpoint-every", "2", "--run-dir", "b"])
    root = tmp_path / "b" / "checkpoints"
    (root / "latest").write_text("ckpt-000002")  # as if it had stopped at 2
    for d in root.glob("ckpt-000004*"):
        shutil.rmtree(d)
    main(["train", "--resume", "--run-dir", "b", "--iterations", "4", "--checkpoint-every", "2", "--no-progress"])
    wa = load_file(str(ckpt.resolve(tmp_path / "a/checkpoints") / "weights.safetensors"))
    wb = load_file(str(ckpt.resolve(root) / "weights.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "anneals to 0" not in capsys.readouterr().err
    main(["train", "--resume", "--run-dir", "b", "--iterations", "6", "--no-progress"])
    state = json.loads((ckpt.resolve(root) / "state.json").read_text())
    assert state["config"]["anneal_iterations"] == 4  # the schedule's horizon survived --iterations 6
    # ... and the user is told that the 2 iterations past it do not learn, and how to stretch it
    assert ("shoal train: the learning rate anneals to 0 at iteration 4 (--anneal-iterations, kept from the run "
            "resumed), so iterations 5..6 will not learn: pass --anneal-iterations 6") in capsys.readouterr().err


def test_a_resume_trains_with_its_new_lr_keeps_the_first_record_and_the_checkpoints_asked_for(tmp_path, monkeypatch):
    """Without annealing, the resumed optimizer kept the checkpoint's rate while config.json said --lr's; run.json
    kept only the resume's command line. And --keep-checkpoints 0 keeps them all (the newest 3 by default)."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--iterations", "3", "--no-anneal-lr", "--lr", "0.0025", "--run-dir", "r",
          "--checkpoint-every", "1", "--keep-checkpoints", "0"])
    main(["train", "--resume", "--run-dir", "r", "--iterations", "4", "--lr", "0.1", "--no-progress"])
    assert len(list((tmp_path / "r" / "checkpoints").glob("ckpt-*"))) == 4  # --keep-checkpoints 0: every one
    state = json.loads((ckpt.resolve(tmp_path / "r" / "checkpoints") / "state.json").read_text())
    assert state["config"]["lr"] == 0.1
    assert state["learners"]["agent"]["optimizer"]["param_groups"][0]["lr"] == 0.1
    record = json.loads((tmp_path / "r" / "run.json").read_text())  # the start's record kept, the resume added
    assert len(record["resumes"]) == 1 and record["started"] < record["resumes"][0]["started"]


def test_training_that_only_skips_updates_stops_naming_the_policy_and_tensor():
    trainer = build_trainer(TrainConfig(env="builtin:cartpole", iterations=10, max_skipped_updates=2,
                                        rollout=RolloutConfig(num_envs=8, fragment_length=32)))
    learner = trainer.learners["agent"]
    with torch.no_grad():
        learner.policy.actor_out.weight.fill_(float("nan"))
    trainer.train()  # the first all-skipped update
    with pytest.raises(NonFiniteTraining, match=r"policy 'agent'.*parameter 'actor_out.weight'"):
        trainer.train()


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_diverging_run_ends_in_one_paragraph_with_the_way_to_continue(tmp_path, monkeypatch, capsys, backend,
                                                                         request):
    """A learning rate that makes every update non-finite: exit 2 with the policy, the flags to change and the
    resume command, never a traceback (on Ray the learner actor's error carries it); the iterations before are
    in the checkpoint, and the run resumes from it with a lower --lr."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    ray = []
    if backend == "ray":
        request.getfixturevalue("ray_session")
        ray = ["--backend", "ray", "--ray.worker-num-cpus", "0", "--ray.learner-num-cpus", "0", "--loggers", "csv"]
    with pytest.raises(SystemExit) as exit_:
        main(["train", *ARGS, *ray, "--lr", "1e30", "--no-anneal-lr", "--max-skipped-updates", "2", "--iterations",
              "8", "--run-dir", "r"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    err = err.strip().splitlines()[-1]  # Ray prints its progress lines first
    assert "shoal train: policy 'agent': 2 consecutive updates were skipped entirely" in err, err
    assert "(--lr)" in err and "raise --max-skipped-updates" in err, err
    assert "continue with shoal train --resume --run-dir r and, say, a lower --lr" in err, err
    saved = ckpt.load_checkpoint(tmp_path / "r" / "checkpoints")[2]["iteration"]
    assert saved >= 1 and _iterations(tmp_path / "r" / "metrics.csv")[-1] == saved
    main(["train", "--resume", "--run-dir", "r", "--lr", "1e-3", *ray, "--iterations", str(saved + 1)])
    assert _iterations(tmp_path / "r" / "metrics.csv") == list(range(1, saved + 2))


def test_metrics_that_appear_later_get_their_own_column_and_keep_earlier_rows(tmp_path):
    from orchestration.metrics_log import MetricsLog, read_csv

    log = MetricsLog(tmp_path, tensorboard=False)
    log.write(10, {"iteration": 1, "loss": 0.5})
    log.write(20, {"iteration": 2, "loss": 0.4, "eval_return_mean": 9.0})  # evaluation every 2 iterations
    log.write(30, {"iteration": 3, "loss": 0.3})
    data = read_csv(tmp_path / "metrics.csv")
    assert data["iteration"] == [1, 2, 3] and data["eval_return_mean"][1] == 9.0
    assert all(v != v for v in (data["eval_return_mean"][0], data["eval_return_mean"][2]))  # empty cells: NaN


def test_a_second_ctrl_c_while_the_interrupted_run_saves_does_not_cut_the_checkpoint_short(tmp_path, monkeypatch):
    """Ctrl-C, then Ctrl-C again while the run writes its checkpoint on the way out: the checkpoint is written
    (what was trained since the last one would be lost), and the first interrupt still ends the run."""
    import threading

    from orchestration import run_loop

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    config = TrainConfig(env="builtin:cartpole", iterations=3, run_dir=str(tmp_path), checkpoint_every=0,
                         checkpoint_every_s=0, rollout=RolloutConfig(num_envs=8, fragment_length=32))
    trainer = build_trainer(config)
    train, real_save = trainer.train, run_loop.save_checkpoint

    def interrupted_second():
        if trainer.iteration == 1:
            raise KeyboardInterrupt  # Ctrl-C during the second iteration
        return train()

    def saving(*args, **kwargs):  # the second Ctrl-C arrives while the checkpoint is written
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        return real_save(*args, **kwargs)

    trainer.train = interrupted_second
    monkeypatch.setattr(run_loop, "save_checkpoint", saving)
    with pytest.raises(KeyboardInterrupt):
        run_loop.run_training(trainer, config, resume=False, progress=False)
    _, _, state = ckpt.load_checkpoint(tmp_path / "checkpoints")
    assert state["iteration"] == 1


def test_a_token_given_by_flag_is_not_written_into_the_run_files(tmp_path, monkeypatch):
    """config.json and run.json are not secrets (mode 0644, copied around); the token lives in its 0600 file."""
    from orchestration import run_loop
    from orchestration.config import ExternalConfig

    monkeypatch.setattr(sys, "argv", ["shoal", "train", "--external.token", "s3cret", "--external.token=s3cret"])
    config = TrainConfig(env="builtin:cartpole", iterations=1, run_dir=str(tmp_path), external=ExternalConfig(
        token="s3cret"), rollout=RolloutConfig(num_envs=8, fragment_length=32))
    run_loop.run_training(build_trainer(config), config, resume=False, progress=False)
    for name in ("config.json", "run.json"):
        assert "s3cret" not in (tmp_path / name).read_text(), name
    assert json.loads((tmp_path / "run.json").read_text())["argv"][2:] == [
        "--external.token", "<redacted>", "--external.token=<redacted>"]
