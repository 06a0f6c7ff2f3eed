"""The ``shoal`` command end to end in fresh processes: train, resume in a new process, evaluate, export."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

ARGS = ["builtin:cartpole", "--rollout.num-envs", "8", "--rollout.fragment-length", "32", "--seed", "3",
        "--no-progress", "--no-anneal-lr"]


def _start(*args: str, cwd) -> subprocess.Popen:
    """``shoal ARGS`` in a new process, started (independent commands run side by side: each spends seconds
    importing torch)."""
    return subprocess.Popen([sys.executable, "-m", "orchestration.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> str:
    """The stdout of a :func:`_start` ed command, which must succeed."""
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return out


def _shoal(*args: str, cwd) -> str:
    return _finish(_start(*args, cwd=cwd))


def _rows(path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_resume_in_a_new_process_equals_an_uninterrupted_run(tmp_path):
    evaluated = [*ARGS, "--eval-every", "1", "--eval-episodes", "4"]  # the evaluator's envs resume too
    straight = _start("train", *evaluated, "--iterations", "4", "--run-dir", str(tmp_path / "straight"), cwd=tmp_path)
    _shoal("train", *evaluated, "--iterations", "2", "--run-dir", str(tmp_path / "split"), cwd=tmp_path)
    _finish(straight)
    out = _shoal("train", "--resume", "--run-dir", str(tmp_path / "split"), "--iterations", "4", "--no-progress",
                 cwd=tmp_path)
    assert json.loads(out.strip().splitlines()[-1])["env_steps"] == 4 * 8 * 32
    straight, split = _rows(tmp_path / "straight/metrics.csv"), _rows(tmp_path / "split/metrics.csv")
    assert len(straight) == len(split) == 4
    for a, b in zip(straight, split):
        for key in ("env_steps", "episodes_total", "loss_policy", "loss_value", "approx_kl", "episode_return_mean",
                    "eval_return_mean"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-6, abs=1e-7), key
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "straight/checkpoints/ckpt-000004/weights.safetensors"))
    wb = load_file(str(tmp_path / "split/checkpoints/ckpt-000004/weights.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "split/learning_curve.png").stat().st_size > 1000


def test_resuming_a_finished_run_trains_nothing_writes_no_checkpoint_and_reports_the_run(tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--iterations", "2", "--checkpoint-every", "1", "--run-dir", str(run)])
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the last iteration's periodic checkpoint is the final one: not written twice (a copy would push ckpt 1 out)
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt-*")) == ["ckpt-000001", "ckpt-000002"]
    main(["train", "--resume", "--run-dir", str(run), "--no-progress"])
    captured = capsys.readouterr()
    again = json.loads(captured.out.strip().splitlines()[-1])
    assert "at iteration 2 already (--iterations 2); nothing was trained" in captured.err
    assert again["env_steps"] == first["env_steps"] == 2 * 8 * 32
    assert again["episode_return_mean"] == pytest.approx(first["episode_return_mean"])
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt-*")) == ["ckpt-000001", "ckpt-000002"]
    # a new run into the same directory would mix two runs' checkpoints and logs: refused, naming --resume
    with pytest.raises(SystemExit) as exit_:
        main(["train", *ARGS, "--iterations", "1", "--run-dir", str(run)])
    assert exit_.value.code == 2 and f"holds a run already (its checkpoints): continue it with --resume --run-dir {run}" \
        in capsys.readouterr().err
    main(["train", "--resume", "--run-dir", str(run), "--env", "CartPole-v1", "--no-progress",  # said, not hidden
          "--ray.learners-per-policy", "2", "--external.instances", "2"])
    err = capsys.readouterr().err
    assert "the run was trained on env 'builtin:cartpole' and goes on with --env 'CartPole-v1'" in err
    assert "--ray.learners-per-policy applies to --backend ray only; this run is local and does not use it" in err
    assert "--external.instances applies to --env external only; this run trains CartPole-v1 and does not use it" in err


@pytest.mark.slow
def test_evaluate_and_export_a_checkpoint(tmp_path, monkeypatch):
    from orchestration.cli import main

    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--iterations", "2", "--run-dir", str(run)])  # in-process: evaluate, export are the subject
    evaluating = _start("evaluate", str(run / "checkpoints"), "--episodes", "3", "--num-envs", "3", cwd=tmp_path)
    exporting = _start("export", str(run / "checkpoints"), "--out", str(tmp_path / "policy"), cwd=tmp_path)
    # The same checkpoint evaluated in this process by the trainer's own evaluator (same seed, envs, weights)
    # gives the same returns: the command loaded the checkpoint's policies, not fresh ones.
    from orchestration.builder import build_trainer
    from orchestration.checkpoint import load_checkpoint
    from orchestration.run_state import load_config, restore_trainer_

    parts = load_checkpoint(run / "checkpoints")
    config = load_config(parts[2])
    trainer = build_trainer(type(config)(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                            "eval_every": 1, "eval_episodes": 3}))
    restore_trainer_(trainer, *parts)
    expected = trainer.evaluate(3)["eval_return_mean"]
    fresh = build_trainer(type(config)(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                          "eval_every": 1, "eval_episodes": 3})).evaluate(3)["eval_return_mean"]
    result = json.loads(_finish(evaluating).splitlines()[-1])
    assert result["episodes"] == 3 and result["eval_return_mean"] == expected != fresh
    assert result["eval_return_std"] >= 0.0
    _finish(exporting)
    manifest = json.loads((tmp_path / "policy/manifest.json").read_text())
    # The exported program runs with torch alone (no Shoal import) and acts like the trained policy.
    code = f"""
import torch, json
program = torch.export.load({str(tmp_path / 'policy/agent.pt2')!r}).module()
obs = torch.zeros(5, 1, 4)
with torch.no_grad():
    action = program(obs, action_mask=torch.ones(5, 1, 2, dtype=torch.bool))
print(json.dumps(action.tolist()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert manifest["policies"]["agent"]["observation_keys"] == ["observation"]
    assert len(json.loads(out.stdout)) == 5


@pytest.mark.parametrize("args, named", [
    (["evaluate", "{ckpt}", "--episodes", "0"], "--episodes must be >= 1, got 0"),
    (["evaluate", "{ckpt}", "--threads", "0"], "--threads must be >= 1, got 0"),  # was torch's traceback
    (["evaluate", "{ckpt}", "--seats", "agent"], "--seats agent chooses the seats the checkpoint plays against "
     "--opponent; without one"),  # was ignored
    (["evaluate", "{ckpt}", "--opponent", "random", "--seats", "agent", "agent"], "--seats names ['agent'] twice"),
    (["evaluate", "{ckpt}", "--opponent", "random"], "env 'builtin:cartpole' has one agent ('agent')"),
    (["export", "{ckpt}", "--out", "{run}/metrics.csv/x"], "--out {run}/metrics.csv/x: cannot make that directory"),
])
def test_a_checkpoints_user_error_is_one_paragraph(cartpole_run, capsys, args, named):
    from orchestration.cli import main

    fill = {"ckpt": str(cartpole_run / "checkpoints"), "run": str(cartpole_run)}
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**fill) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and named.format(**fill) in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    from orchestration.cli import main

    run = tmp_path_factory.mktemp("cartpole") / "run"
    main(["train", *ARGS, "--iterations", "1", "--run-dir", str(run)])
    return run


def test_resume_auto_starts_a_run_then_resumes_it(tmp_path, monkeypatch, capsys):
    """One command for a supervisor that restarts the run: the first start starts it, the next resumes it, also
    when a kill fell between a checkpoint's rename and its ``latest`` pointer's (the checkpoint is there, its
    pointer is not: chaos_runner met this window)."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    for iterations in (1, 2, 3):
        main(["train", *ARGS, "--iterations", str(iterations), "--resume=auto", "--run-dir", str(tmp_path / "r")])
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["env_steps"] == iterations * 8 * 32
        if iterations == 1:
            (tmp_path / "r" / "checkpoints" / "latest").unlink()
    assert len(_rows(tmp_path / "r" / "metrics.csv")) == 3  # one row per iteration: none again, none lost


def test_zero_iterations_is_a_valid_run(tmp_path, monkeypatch):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", "builtin:cartpole", "--iterations", "0", "--no-progress", "--run-dir", "z"])
    assert (tmp_path / "z" / "checkpoints" / "latest").exists()


def test_a_yaml_config_is_strict_and_reproduces_a_run(tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("env: builtin:cartpole\nrollout:\n  num_env: 4\n")
    with pytest.raises(SystemExit):
        main(["train", "--config-file", "bad.yaml", "--no-progress"])
    assert "unknown key 'rollout.num_env' (did you mean 'rollout.num_envs'?)" in capsys.readouterr().err
    (tmp_path / "dotted.yaml").write_text("env: builtin:cartpole\nrollout.num_envs: 4\n")
    with pytest.raises(SystemExit):
        main(["train", "--config-file", "dotted.yaml", "--no-progress"])
    assert "key 'rollout.num_envs' is a dotted path; a config file nests its sections: rollout: {num_envs: ...}" \
        in capsys.readouterr().err
    (tmp_path / "run.yaml").write_text("env: builtin:cartpole\niterations: 2\nseed: 5\n"
                                       "rollout: {num_envs: 4, fragment_length: 16}\nppo: {num_epochs: 2}\n")
    for name in ("a", "b"):
        main(["train", "--config-file", "run.yaml", "--run-dir", name, "--no-progress"])
    assert _rows(tmp_path / "a/metrics.csv")[-1]["loss_value"] == _rows(tmp_path / "b/metrics.csv")[-1]["loss_value"]


@pytest.mark.ray
def test_a_ray_resume_that_takes_state_away_names_the_setting(tmp_path, monkeypatch, capsys, ray_session):
    """On Ray the learner's load fails inside its actor: the same one paragraph as locally, not a traceback."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    ray = ["--backend", "ray", "--ray.worker-num-cpus", "0", "--ray.learner-num-cpus", "0", "--loggers", "csv"]
    main(["train", *ARGS, *ray, "--iterations", "1", "--run-dir", "r", "--policy.normalize-observations"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume", "--run-dir", "r", "--iterations", "2", "--no-progress", *ray,
              "--policy.no-normalize-observations"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert ("changes --policy.normalize-observations True -> False (Unexpected key(s) in state_dict: "
            "\"actor_encoder.obs_") in err, err


def test_a_yaml_config_takes_yaml_1_1_floats_and_an_inline_collection(tmp_path):
    from orchestration.cli import _config_from_file

    (tmp_path / "run.yaml").write_text(
        "lr: 1e-3\npolicy: {hidden_sizes: [32, 32]}\ncollection:\n  format: shoal.envcollection/1\n"
        "  members: {easy: builtin:cartpole, hard: builtin:cartpole}\n"
        "  structure: {kind: split, train: [easy], test: [hard]}\n")
    config = _config_from_file(str(tmp_path / "run.yaml"))
    assert config.lr == 1e-3 and config.policy.hidden_sizes == (32, 32)  # PyYAML reads 1e-3 as a string
    assert json.loads(config.collection)["structure"]["test"] == ["hard"]


def test_a_resume_names_the_settings_it_changes_and_refuses_a_new_seed(tmp_path, monkeypatch, capsys):
    """A checkpoint whose shapes no longer fit (another network, env count or env) is refused in one paragraph
    naming the flags that changed, with their saved and new values; the run directory is left as it was."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--iterations", "1", "--run-dir", "r"])
    capsys.readouterr()
    for flags, named in ((["--policy.hidden-sizes", "32"], "--policy.hidden-sizes (64, 64) -> (32,) (size mismatch for"),
                         (["--rollout.num-envs", "4"], "--rollout.num-envs 8 -> 4"),
                         # state a setting adds: the checkpoint lacks it (tensors of the same shapes otherwise)
                         (["--policy.normalize-observations"], "--policy.normalize-observations False -> True "
                                                               "(Missing key(s) in state_dict: \"actor_encoder.obs_")):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--resume", "--run-dir", "r", "--iterations", "2", "--no-progress", *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and named in err and "does not fit this run" in err, err
    with pytest.raises(SystemExit) as exit_:  # another env: where its tree differs, not a state dict's keys
        main(["train", "--resume", "--run-dir", "r", "--iterations", "2", "--no-progress", "--env", "builtin:spread"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and ("the checkpoint's run played builtin:cartpole, and this run's builtin:spread has "
                                      "other agents, observations or actions: ") in err and "--env builtin:cartpole" \
        in err, err
    with pytest.raises(SystemExit):  # a learning rate changed alongside is not what does not fit
        main(["train", "--resume", "--run-dir", "r", "--iterations", "2", "--no-progress", "--lr", "0.01",
              "--policy.hidden-sizes", "32"])
    err = capsys.readouterr().err
    assert "--policy.hidden-sizes (64, 64) -> (32,)" in err and "--lr" not in err, err
    assert [p.name for p in (tmp_path / "r" / "checkpoints").glob("ckpt-*")] == ["ckpt-000001"]
    # a gymnasium env saves no env state: the actor's episode counters are what no longer fit
    main(["train", "CartPole-v1", "--rollout.num-envs", "2", "--rollout.fragment-length", "8", "--iterations", "1",
          "--run-dir", "g", "--no-progress"])
    capsys.readouterr()
    saved = (tmp_path / "g" / "config.json").read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume", "--run-dir", "g", "--iterations", "2", "--no-progress", "--rollout.num-envs", "4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--rollout.num-envs 2 -> 4" in err and "Traceback" not in err, err
    assert "anneals to 0" not in err, err  # past the saved schedule (1): its note would only precede the refusal
    assert (tmp_path / "g" / "config.json").read_text() == saved
    main(["train", "CartPole-v1", "--rollout.num-envs", "2", "--rollout.env-processes", "2", "--rollout.env-polling",
          "--rollout.fragment-length", "8", "--iterations", "1", "--run-dir", "p", "--no-progress"])  # polled streams
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume", "--run-dir", "p", "--iterations", "2", "--no-progress", "--rollout.num-envs", "4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--rollout.num-envs 2 -> 4" in err and "Traceback" not in err, err
    assert "anneals to 0" not in err, err  # past the saved schedule (1): its note would only precede the refusal
    with pytest.raises(SystemExit) as exit_:  # was taken silently: written to config.json, changing nothing
        main(["train", "--resume", "--run-dir", "g", "--iterations", "2", "--no-progress", "--seed", "9"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--seed 9 on a resume" in err and "started with --seed 0" in err, err
    main(["train", "--resume", "--run-dir", "g", "--iterations", "2", "--no-progress", "--env-kwargs",
          "sutton_barto_reward", "True"])  # said: the keywords given replace the saved ones
    assert ("trained with --env-kwargs (none) and goes on with --env-kwargs sutton_barto_reward True"
            in capsys.readouterr().err)


def test_evaluate_on_an_env_of_another_tree_names_it_and_the_difference(cartpole_run, capsys):
    from orchestration.cli import main

    with pytest.raises(SystemExit) as exit_:  # was: "group agent: observation: shape (4, 1, 3) does not end with"
        main(["evaluate", str(cartpole_run), "--env", "Pendulum-v1", "--episodes", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--env Pendulum-v1: the checkpoint's policies were trained on builtin:cartpole, " \
        "whose observations and actions differ: at " in err and "Traceback" not in err, err


def test_evaluate_takes_env_kwargs_and_drops_the_checkpoints_for_another_env(tmp_path, capsys):
    """The checkpoint's --env-kwargs were carried to another --env (refused as keywords it does not take); for its
    own env, --env-kwargs go on top of them (a recall policy at a longer delay; they used to replace them all, so
    ``delay 6`` alone dropped ``num_cues 3`` and was refused naming builtin:recall on both sides)."""
    from orchestration.cli import main

    run = tmp_path / "recall"
    main(["train", "builtin:recall", "--env-kwargs", "num_cues", "3", "--rollout.num-envs", "4",
          "--rollout.fragment-length", "8", "--iterations", "1", "--run-dir", str(run), "--no-progress"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", str(run), "--env", "builtin:cartpole", "--episodes", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--env builtin:cartpole: the checkpoint's policies were trained on " \
        "builtin:recall, whose observations and actions differ" in err and "num_cues" not in err, err
    main(["evaluate", str(run), "--env-kwargs", "num_cues", "3", "delay", "6", "--episodes", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["episodes"] == 2
    main(["evaluate", str(run), "--env-kwargs", "delay", "6", "--episodes", "2"])  # num_cues 3 kept
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["episodes"] == 2
    with pytest.raises(SystemExit) as exit_:  # two cues: another observation than the checkpoint's three
        main(["evaluate", str(run), "--env-kwargs", "num_cues", "2", "--episodes", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--env builtin:recall --env-kwargs num_cues 2: the checkpoint's policies were " \
        "trained on builtin:recall with num_cues 3, whose" in err and "in builtin:recall with num_cues 2" in err, err


def test_a_run_directory_names_its_checkpoints(cartpole_run, capsys):
    from orchestration.cli import main

    main(["evaluate", str(cartpole_run), "--episodes", "2"])  # the run, not its checkpoints directory
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["episodes"] == 2


def test_evaluate_plays_the_episodes_of_its_seed(cartpole_run, capsys):
    """The same seed plays the same episodes, another seed other ones; the default is the run's seed (3)."""
    from orchestration.cli import main

    def returns(*flags):
        main(["evaluate", str(cartpole_run), "--episodes", "4", "--sample", *flags])
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval_return_mean"]

    assert returns("--seed", "5") == returns("--seed", "5") != returns("--seed", "6")
    assert returns() == returns("--seed", "3") != returns("--seed", "0")
