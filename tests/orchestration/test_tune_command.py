"""``shoal tune``: a sweep from a config file on Ray Tune (the session's Ray instance), its results table, and
the errors that name a mistyped key or search before any trial starts."""

from __future__ import annotations

import csv
import json

import pytest

from orchestration.checkpoint import load_checkpoint
from orchestration.metrics_log import read_csv

SWEEP = """\
env: builtin:cartpole
iterations: 2
rollout: {num_envs: 4, fragment_length: 16}
ppo: {num_epochs: 1, minibatch_size: 32}
search:
  seed: {grid: [0, 1]}
"""


@pytest.mark.ray
def test_a_grid_over_two_seeds_runs_both_trials_and_writes_the_results_table(ray_session, tmp_path, capsys):
    pytest.importorskip("ray.tune", exc_type=ImportError)  # ray[tune]: pandas, pyarrow, tensorboardX
    from orchestration.sweeps import main

    (tmp_path / "sweep.yaml").write_text(SWEEP)
    code = main(["--config-file", str(tmp_path / "sweep.yaml"), "--storage", str(tmp_path / "tune"), "--name",
                 "seeds", "--cpus-per-trial", "0.5", "--verbose", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    with open(tmp_path / "tune" / "seeds" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["seed"] for r in rows) == ["0", "1"]
    assert all(r["status"] == "ok" and r["iterations"] == "2" and r["env_steps"] == "128" for r in rows)
    assert json.loads((tmp_path / "tune" / "seeds" / "results.json").read_text())[0]["episode_return_mean"] > 0
    header = next(line for line in out.splitlines() if line.startswith("trial"))
    assert header.split() == ["trial", "seed", "iterations", "env_steps", "episode_return_mean", "status"]
    for row in rows:  # Tune kept each trial's checkpoint; each trial wrote its metrics like a run
        assert load_checkpoint(row["checkpoint"])[2]["iteration"] == 2
        assert read_csv(f"{row['path']}/metrics.csv")["iteration"] == [1, 2]


@pytest.mark.parametrize("search, named", [
    ("  ppo.clip_ep: {grid: [0.1, 0.2]}", "search: unknown key 'ppo.clip_ep' (did you mean 'ppo.clip_eps'?)"),
    ("  ppo:\n    clip_ep: {grid: [0.1]}", "search: unknown key 'ppo.clip_ep' (did you mean 'ppo.clip_eps'?)"),
    ("  seed: {gird: [0, 1]}", "search.seed: unknown search 'gird' (did you mean 'grid'?)"),
    ("  seed: [0, 1]", "search.seed: expected one of {grid: [...]}"),
    ("  lr: {loguniform: [0, 1.0e-3]}", "search.lr.loguniform: expected [low, high] with low < high and low > 0"),
    ("  rollout.num_envs: {choice: [4, 0]}", "search.rollout.num_envs: 0 is refused"),
])
def test_a_mistake_in_the_search_section_is_named_before_any_trial(tmp_path, capsys, search, named):
    from orchestration.sweeps import main

    (tmp_path / "sweep.yaml").write_text(SWEEP.split("search:")[0] + "search:\n" + search + "\n")
    assert main(["--config-file", str(tmp_path / "sweep.yaml"), "--storage", str(tmp_path / "tune")]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "tune").exists()


def test_a_mistyped_base_key_names_the_nearest_one(tmp_path, capsys):
    from orchestration.sweeps import main

    (tmp_path / "sweep.yaml").write_text(SWEEP.replace("rollout:", "rolout:"))
    assert main(["--config-file", str(tmp_path / "sweep.yaml")]) == 2
    assert "unknown key 'rolout' (did you mean 'rollout'?)" in capsys.readouterr().err


def test_shoal_tune_is_a_command_of_the_cli(tmp_path, capsys):
    from orchestration.cli import main

    (tmp_path / "sweep.yaml").write_text(SWEEP.replace("seed: {grid: [0, 1]}", "sede: {grid: [0, 1]}"))
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--config-file", str(tmp_path / "sweep.yaml")])
    assert exit_.value.code == 2 and "did you mean 'seed'" in capsys.readouterr().err


@pytest.mark.ray
def test_a_metric_of_some_iterations_is_read_from_its_last_report_and_a_misspelt_one_is_named(ray_session, tmp_path,
                                                                                                 capsys):
    """Tune was told the metric and failed every trial whose last report lacked it: an evaluation's metric
    between evaluations, or a misspelt one (a Ray traceback)."""
    pytest.importorskip("ray.tune", exc_type=ImportError)
    from orchestration.sweeps import main

    evaluated = SWEEP.replace("iterations: 2", "iterations: 3\neval_every: 2\neval_episodes: 2")
    (tmp_path / "sweep.yaml").write_text(evaluated.replace("[0, 1]", "[0]"))
    flags = ["--config-file", str(tmp_path / "sweep.yaml"), "--storage", str(tmp_path / "tune"), "--cpus-per-trial",
             "0.5", "--verbose", "0"]
    assert main([*flags, "--name", "eval", "--metric", "eval_return_mean"]) == 0
    rows = json.loads((tmp_path / "tune" / "eval" / "results.json").read_text())
    assert rows[0]["status"] == "ok" and rows[0]["iterations"] == 3 and rows[0]["eval_return_mean"] > 0
    capsys.readouterr()
    assert main([*flags, "--name", "typo", "--metric", "episode_retrun_mean"]) == 2
    err = capsys.readouterr().err
    assert "no trial reported --metric 'episode_retrun_mean' (did you mean 'episode_return_mean'?)" in err, err
    assert "Traceback" not in err
    broken = SWEEP.replace("[0, 1]", "[0]") + "env_kwargs: [[gravity, '-1.0']]\n"
    (tmp_path / "broken.yaml").write_text(broken)
    assert main([*flags, "--config-file", str(tmp_path / "broken.yaml"), "--name", "broken"]) == 2  # before any trial
    assert "--env-kwargs gravity is not a keyword it takes" in capsys.readouterr().err
    (tmp_path / "searched.yaml").write_text(broken.replace("search:\n", "search:\n  env: {grid: [builtin:cartpole]}\n"))
    assert main([*flags, "--config-file", str(tmp_path / "searched.yaml"), "--name", "searched"]) == 1  # trials fail
    err = capsys.readouterr().err  # was: "no trial reported --metric ...; the trials reported ['pid', 'timestamp']"
    assert "every trial failed, the first with" in err and "gravity" in err and "no trial reported" not in err, err


@pytest.mark.parametrize("edit, flags, named", [
    (("env: builtin:cartpole", "env: builtin:cartpol"), [], "unknown built-in env 'builtin:cartpol' (did you mean "
     "'builtin:cartpole'?)"),  # every trial failed with it, after Ray's output and a traceback
    (("", ""), ["--cpus-per-trial", "-1"], "--cpus-per-trial must be > 0, got -1"),  # was Tune's two tracebacks
])
def test_a_bad_env_or_trial_size_is_refused_before_any_trial(tmp_path, capsys, edit, flags, named):
    from orchestration.sweeps import main

    (tmp_path / "sweep.yaml").write_text(SWEEP.replace(*edit) if edit[0] else SWEEP)
    assert main(["--config-file", str(tmp_path / "sweep.yaml"), "--storage", str(tmp_path / "tune"), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "tune").exists()


def test_an_evaluation_metric_without_evaluations_is_refused_before_any_trial(tmp_path, capsys):
    from orchestration.sweeps import main

    (tmp_path / "sweep.yaml").write_text(SWEEP)
    assert main(["--config-file", str(tmp_path / "sweep.yaml"), "--metric", "eval_return_mean"]) == 2
    assert "--metric eval_return_mean is reported by evaluations, and the config has eval_every 0" in \
        capsys.readouterr().err


def test_the_results_table_tells_finished_trials_from_interrupted_and_pending_ones():
    """After an interrupt Tune's grid holds trials that stopped early and trials that never started (no config,
    no metrics): neither is "ok", and a pending one is a row, not a traceback."""
    from types import SimpleNamespace

    from orchestration.sweeps import results_table

    def trial(name, iteration=None, lr=None, error=None, **params):
        metrics = None if iteration is None else {"iteration": iteration, "env_steps": 64 * iteration,
                                                  "episode_return_mean": 10.0 * iteration}
        config = None if lr is None else {"lr": lr, **params}
        return SimpleNamespace(metrics=metrics, config=config, metrics_dataframe=None, error=error, checkpoint=None,
                               path=f"/tune/{name}")

    rows = results_table([trial("a", 4, 1e-3), trial("b", 2, 3e-3), trial("c"), trial("d", 1, 1e-2, RuntimeError()),
                          trial("e", 2, 1e-4, iterations=2)], ["lr"], "episode_return_mean", iterations=4)
    assert [(r["trial"], r["status"], r["iterations"]) for r in rows] == [
        ("a", "ok", 4), ("b", "unfinished", 2), ("c", "unfinished", None), ("d", "error: RuntimeError", 1),
        ("e", "ok", 2)]  # e searched its own iterations
    assert rows[2]["lr"] is None and rows[2]["episode_return_mean"] is None


def test_resuming_an_experiment_that_is_not_there_names_those_that_are(tmp_path, capsys):
    from orchestration.sweeps import main

    (tmp_path / "sweep.yaml").write_text(SWEEP)
    (tmp_path / "tune" / "seeds").mkdir(parents=True)
    (tmp_path / "tune" / "seeds" / "tuner.pkl").write_bytes(b"")  # an experiment Tune wrote (never read here)
    code = main(["--config-file", str(tmp_path / "sweep.yaml"), "--storage", str(tmp_path / "tune"), "--name", "seds",
                 "--resume"])
    assert code == 2 and "--resume: no experiment 'seds' under --storage" in capsys.readouterr().err
