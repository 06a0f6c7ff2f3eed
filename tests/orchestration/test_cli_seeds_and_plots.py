"""``shoal train --seeds`` and ``shoal plot``: one run per seed, checked before any trains, and the curve and
final values drawn over them; the notes a run gives about settings it does not use."""

from __future__ import annotations

import json

import pytest

from tests.orchestration.test_cli import ARGS


def test_seeds_into_a_run_dir_check_every_seed_before_training_any(tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "base" / "seed_1" / "checkpoints" / "ckpt-000001").mkdir(parents=True)  # seed 1 ran before
    with pytest.raises(SystemExit) as exit_:
        main(["train", *ARGS, "--iterations", "1", "--seeds", "0", "1", "--run-dir", str(tmp_path / "base")])
    assert exit_.value.code == 2 and "seed_1 holds a run already" in capsys.readouterr().err
    assert not (tmp_path / "base" / "seed_0").exists()  # refused before seed 0 trained
    (tmp_path / "run.yaml").write_text(f"run_dir: {tmp_path / 'base'}\n")  # the base named by a config file
    with pytest.raises(SystemExit) as exit_:
        main(["train", *ARGS, "--iterations", "1", "--seeds", "0", "1", "--config-file", str(tmp_path / "run.yaml")])
    assert exit_.value.code == 2 and "seed_1 holds a run already" in capsys.readouterr().err
    assert not (tmp_path / "base" / "seed_0").exists()
    with pytest.raises(SystemExit) as exit_:  # --resume on the directory of the seeds' runs: name one of them
        main(["train", "--resume", "--run-dir", str(tmp_path / "base")])
    assert f"base holds the runs of --seeds (seed_1): name one, e.g. {tmp_path / 'base' / 'seed_1'}" in \
        capsys.readouterr().err


def test_runs_get_their_own_directories_with_provenance_and_plot_draws_them(tmp_path, monkeypatch):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", "builtin:cartpole", "--iterations", "2", "--rollout.num-envs", "4",
          "--rollout.fragment-length", "16", "--seeds", "0", "1", "--no-progress"])
    runs = sorted((tmp_path / "runs").iterdir())
    assert [r.name.split("__")[:2] for r in runs] == [["builtin_cartpole", "0"], ["builtin_cartpole", "1"]]
    provenance = json.loads((runs[0] / "run.json").read_text())
    assert provenance["shoal_version"] and "torch" in provenance
    main(["plot", *map(str, runs), "--out", str(tmp_path / "curve.png"), "--metric", "loss_value"])
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_interquartile_mean_trims_a_quarter_each_side():
    from orchestration.metrics_log import interquartile_mean

    assert interquartile_mean([1, 2, 3, 4]) == 2.5 and interquartile_mean([0, 10, 10, 1000]) == 10.0
    assert interquartile_mean([1, 2, 3, 4, 5, 6, 7, 8]) == 4.5


def test_plot_draws_only_where_every_run_has_values_and_its_finals_are_where_the_curve_ends(tmp_path):
    """Runs of unequal length: the curve and the finals stop at the shortest run's last value, and start at
    the latest first value (a run's early iterations without an ended episode are not filled in)."""
    from orchestration.metrics_log import plot_runs

    def run(name: str, steps: range, value) -> str:
        (tmp_path / name).mkdir()
        rows = [f"{s},{value(s)}" for s in steps]
        (tmp_path / name / "metrics.csv").write_text("env_steps,episode_return_mean\n" + "\n".join(rows) + "\n")
        return str(tmp_path / name)

    long = run("long", range(100, 1001, 100), lambda s: s / 100)  # 1 .. 10
    short = run("short", range(100, 501, 100), lambda s: "" if s < 300 else s / 100)  # no episode before 300
    summary = plot_runs([long, short], tmp_path / "c.png")
    assert summary["final_env_steps"] == 500 and summary["final"] == [5.0, 5.0] and summary["final_mean"] == 5.0
    empty = run("empty", range(100, 301, 100), lambda s: "")
    with pytest.raises(ValueError, match="empty has no value of 'episode_return_mean' yet"):
        plot_runs([long, empty], tmp_path / "c.png")
    later = run("later", range(2000, 3001, 500), lambda s: 1.0)
    with pytest.raises(ValueError, match="share no env steps"):
        plot_runs([short, later], tmp_path / "c.png")


def test_plot_names_a_cell_that_is_no_number_and_refuses_runs_of_different_envs(tmp_path, capsys):
    """A non-numeric cell was told as "could not convert string to float: 'abc'" (no file, line or column); runs of
    CartPole and connect four were averaged into one curve and IQM without a word."""
    from orchestration.cli import main

    for name, env, cell in (("a", "CartPole-v1", "2.0"), ("b", "pettingzoo:classic.connect_four_v3", "abc"),
                            ("c", "CartPole-v1", "1.0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text(f"env_steps,episode_return_mean\n100,1.0\n200,{cell}\n")
        (tmp_path / name / "config.json").write_text(json.dumps({"env": env, "collection": None}))
    for runs, told in ((["b"], "b/metrics.csv, line 3, column 'episode_return_mean': 'abc' is not a number"),
                       (["a", "b"], "the runs are of different envs (")):
        with pytest.raises(SystemExit):
            main(["plot", *(str(tmp_path / r) for r in runs), "--out", str(tmp_path / "x.png")])
        err = capsys.readouterr().err
        assert told in err and len(err.strip().splitlines()) == 1, err
    main(["plot", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "x.png")])  # one env: drawn
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"] == [2.0, 1.0]
    (tmp_path / "c" / "config.json").write_text(json.dumps({"env": "CartPole-v1", "collection": None, "seed": 7,
                                                            "anneal_iterations": 9, "policy": {"critic": "central"}}))
    with pytest.raises(SystemExit):  # MAPPO's seeds and IPPO's were one curve, "mean of 4 runs"; seeds may differ
        main(["plot", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert f"the runs differ in policy.critic (None in {tmp_path / 'a'}, 'central' in {tmp_path / 'c'})" in err, err
    assert "seed" not in err.split("; shoal plot")[0] and "anneal" not in err  # a resumed run writes its horizon


def test_plot_takes_a_metrics_file_or_a_directory_of_runs_names_a_near_metric_and_says_when_runs_differ(
        tmp_path, capsys):
    from orchestration.cli import main

    for name, last in (("seed_0", 400), ("seed_1", 300)):
        (tmp_path / "seeds" / name).mkdir(parents=True)
        rows = "\n".join(f"{s},{s / 100}" for s in range(100, last + 1, 100))
        (tmp_path / "seeds" / name / "metrics.csv").write_text(f"env_steps,episode_return_mean\n{rows}\n")
    main(["plot", str(tmp_path / "seeds"), "--out", str(tmp_path / "a.png")])  # the --run-dir of a --seeds run
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert [p.rsplit("/", 1)[1] for p in summary["runs"]] == ["seed_0", "seed_1"] and summary["final"] == [3.0, 3.0]
    assert "the runs end at different env steps (300 to 400); the curve and the finals stop at 300" in captured.err
    main(["plot", str(tmp_path / "seeds" / "seed_0" / "metrics.csv"), "--out", str(tmp_path / "b.png")])
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["final"] == [4.0] and one["final_ci95"] is None  # was [4.0, 4.0]: no interval from one run
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "seeds"), "--metric", "episode_retrun_mean", "--out", str(tmp_path / "c.png")])
    assert "has no column 'episode_retrun_mean' (did you mean 'episode_return_mean'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a run named as a file and again under its directory: counted once, never twice
        main(["plot", str(tmp_path / "seeds" / "seed_0" / "metrics.csv"), str(tmp_path / "seeds")])
    assert "seed_0 named twice" in capsys.readouterr().err


def test_settings_a_run_does_not_use_are_named_not_dropped(capsys):
    from core.losses import PPOConfig
    from core.policies import PolicyConfig
    from orchestration.config import (CuriosityConfig, ExternalConfig, PretrainConfig, RayConfig, RolloutConfig,
                                      TrainConfig)
    from orchestration.run_notes import note_unused
    from orchestration.team_critic_config import TeamCriticConfig

    note_unused("train", TrainConfig(pretrain=PretrainConfig(steps=50), curiosity=CuriosityConfig(lr=0.1),
                                     ppo=PPOConfig(sequence_length=8, burn_in=4)))
    err = capsys.readouterr().err
    assert "--pretrain.steps applies to runs with --pretrain.dataset only; this run has none and does not use it" in err
    assert "--curiosity.lr applies to --curiosity.coef > 0 only; this run's is 0" in err
    assert "--ppo.sequence-length, --ppo.burn-in apply to recurrent policies only (--policy.recurrent)" in err
    note_unused("train", TrainConfig(policy=PolicyConfig(recurrent=True), ppo=PPOConfig(sequence_length=8),
                                     curiosity=CuriosityConfig(coef=0.1, lr=0.1)))
    assert capsys.readouterr().err == ""  # used: nothing to say
    # an LSTM asked for without --policy.recurrent trained a feed-forward policy in silence; so did these
    note_unused("train", TrainConfig(policy=PolicyConfig(recurrent_cell="lstm", recurrent_size=16), max_staleness=3,
                                     reuse_limit=2, address="127.0.0.1:1234", ray=RayConfig(iteration_timeout_s=5)))
    err = capsys.readouterr().err
    assert "--policy.recurrent-cell, --policy.recurrent-size apply to recurrent policies only" in err
    assert "--max-staleness, --reuse-limit apply to --mode async only; this run is synchronous" in err
    assert "--address applies to --backend ray only" in err
    assert "--ray.iteration-timeout-s applies to --backend ray only" in err
    note_unused("train", TrainConfig(mode="async", max_staleness=3, ray=RayConfig(iteration_timeout_s=5)))
    assert capsys.readouterr().err == ""  # the iteration timeout guards async runs on either backend
    note_unused("train", TrainConfig(eval_episodes=5))  # evaluations are never run: the count was taken in silence
    assert "--eval-episodes applies to evaluations every --eval-every N iterations only" in capsys.readouterr().err
    note_unused("train", TrainConfig(eval_episodes=5, eval_every=2))
    assert capsys.readouterr().err == ""
    note_unused("train", TrainConfig(env="external", rollout=RolloutConfig(env_processes=1, check="lenient")))
    assert ("--rollout.env-processes, --rollout.check apply to envs Shoal steps itself; this run trains on external "
            "simulators and does not use them") in capsys.readouterr().err
    note_unused("serve", TrainConfig(env="external", external=ExternalConfig(instances=3)))
    assert ("--external.instances applies to simulators launched by --external.command; this run launches none and "
            "does not use it") in capsys.readouterr().err
    note_unused("serve", TrainConfig(env="external", external=ExternalConfig(instances=3, command="sim {port}")))
    assert capsys.readouterr().err == ""
    note_unused("serve", TrainConfig(env="external", external=ExternalConfig(start_timeout_s=4)))
    assert capsys.readouterr().err == ""  # without a launcher: the wait for the first simulator's tree
    # dropped in silence too: --env beside a collection, env keywords of external simulators, a critic's settings
    collection = '{"format": "shoal.envcollection/1", "members": {"a": "builtin:cartpole"}}'
    note_unused("train", TrainConfig(env="Pendulum-v1", collection=collection))
    note_unused("serve", TrainConfig(env="external", env_kwargs={"foo": 1}))
    note_unused("train", TrainConfig(team_critic=TeamCriticConfig(lr=0.01)))
    err = capsys.readouterr().err
    assert "--env applies to runs without --collection only; this run trains the collection's envs" in err
    assert "--env-kwargs applies to envs Shoal builds itself; external simulators bring their own" in err
    assert "--team-critic.lr applies to --team-critic.enabled only; this run has no team critic" in err
    note_unused("train", TrainConfig(policy=PolicyConfig(recurrent=True), ppo=PPOConfig(sequence_length=20),
                                     rollout=RolloutConfig(fragment_length=10)))
    assert "--ppo.sequence-length 20 is longer than --rollout.fragment-length 10: sequences are whole fragments" \
        in capsys.readouterr().err
    note_unused("train", TrainConfig(pretrain=PretrainConfig(dataset="ds", steps=0)))  # loaded, and trained on 0 steps
    assert "--pretrain.steps 0: the dataset ds is loaded and checked against the env's tree, and nothing is cloned" \
        in capsys.readouterr().err
    note_unused("train", TrainConfig(ppo=PPOConfig(minibatch_size=100_000)))  # was cut to the batch in silence
    assert ("--ppo.minibatch-size 100000 is more than the 1024 env steps of a batch" in capsys.readouterr().err)


def test_a_large_share_of_stale_fragments_is_said_once_with_what_keeps_them(capsys):
    """A run that drops a quarter or more of what it made as stale says so, with the setting that keeps it: an
    external run in sync mode (its simulators act while the learner trains) is told about async mode."""
    from orchestration.config import TrainConfig
    from orchestration.run_notes import note_stale

    external_sync = TrainConfig(env="external", mode="sync")
    assert not note_stale("serve", external_sync, {"fragments_produced": 40, "fragments_stale": 9})
    assert not note_stale("serve", external_sync, {"fragments_produced": 6, "fragments_stale": 5})  # too few yet
    assert capsys.readouterr().err == ""
    assert note_stale("serve", external_sync, {"fragments_produced": 375, "fragments_stale": 187})
    err = capsys.readouterr().err
    assert "shoal serve: 187 of the 375 fragments made so far were dropped as stale" in err
    assert "simulators keep acting while the learner trains" in err and "--mode async --max-staleness 1" in err
    two = {"fragments_produced": 20, "a/fragments_stale": 1, "b/fragments_stale": 6}  # the worst learner's
    assert note_stale("train", TrainConfig(mode="async", max_staleness=1), two)
    assert "6 of the 20" in (err := capsys.readouterr().err) and "more than --max-staleness 1 versions" in err


def test_policy_settings_with_nothing_to_act_on_are_named(capsys, tmp_path):
    """Image encoder settings without an image observation, normalisation without a float vector, a burn-in
    without shorter sequences: each said, not ignored in silence; the same settings where they act say nothing."""
    from core.losses import PPOConfig
    from core.policies import PolicyConfig
    from orchestration.config import RolloutConfig, TrainConfig
    from orchestration.envs import make_env
    from orchestration.run_notes import note_capped, note_policy_fit

    cartpole, spot = make_env("builtin:cartpole", 1).tree, make_env("builtin:spot", 1).tree
    note_policy_fit("train", TrainConfig(env="builtin:cartpole", policy=PolicyConfig(image_encoder="impala",
                                                                         image_features=32)), cartpole)
    assert ("--policy.image-encoder, --policy.image-features apply to image observations (3-D boxes with 1, 3 or 4 "
            "channels first or last and sides >= 8), and builtin:cartpole has none") in capsys.readouterr().err
    note_policy_fit("train", TrainConfig(env="builtin:spot", policy=PolicyConfig(normalize_observations=True)), spot)
    assert "--policy.normalize-observations standardises float vector observations, and builtin:spot has none" \
        in capsys.readouterr().err
    note_policy_fit("train", TrainConfig(env="builtin:spot", policy=PolicyConfig(image_encoder="impala")), spot)
    note_policy_fit("train", TrainConfig(policy=PolicyConfig(normalize_observations=True)), cartpole)
    assert capsys.readouterr().err == ""
    note_policy_fit("train", TrainConfig(env="builtin:cartpole", policy=PolicyConfig(critic="central")), cartpole)
    assert "--policy.critic central reads every agent's observation, and builtin:cartpole has one agent" \
        in capsys.readouterr().err
    spread = make_env("builtin:spread", 1).tree
    note_policy_fit("train", TrainConfig(env="builtin:spread", policy=PolicyConfig(critic="joint")), spread)
    assert capsys.readouterr().err == ""
    recurrent = PolicyConfig(recurrent=True)
    note_capped("train", TrainConfig(policy=recurrent, ppo=PPOConfig(burn_in=3),
                                     rollout=RolloutConfig(fragment_length=10)))
    assert "--ppo.burn-in 3 does nothing here: sequences are whole fragments" in capsys.readouterr().err
    note_capped("train", TrainConfig(policy=recurrent, ppo=PPOConfig(burn_in=3, sequence_length=5),
                                     rollout=RolloutConfig(fragment_length=10)))
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="leaf_encoders must be pairs naming each leaf once"):
        PolicyConfig(leaf_encoders=(("observation", "impala"), ("observation", "flatten")))
    from orchestration.cli import main

    main(["train", "builtin:cartpole", "--fixed-policies", "agent", "--iterations", "0", "--run-dir",
          str(tmp_path / "fixed"), "--no-progress"])  # started in silence, no loss column
    assert "no policy learns in this run (every one is fixed" in capsys.readouterr().err


def test_a_seed_named_twice_is_refused_before_any_run_and_a_dropped_seed_is_said(tmp_path, capsys):
    from orchestration.cli import _seeds, main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "builtin:cartpole", "--iterations", "1", "--run-dir", str(tmp_path / "r"), "--seeds", "0", "0"])
    assert exit_.value.code == 2 and "--seeds 0 0 names a seed twice" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # was: seed 0 trained, then its second run found the directory used
    assert _seeds(["--seeds", "3", "--seed", "5"]) == (["--seed", "5"], [3])
    assert "--seed is not used with --seeds" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.slow
def test_seeds_on_the_ray_backend_train_each_seed_as_the_local_backend_does(tmp_path, ray_session):
    """``--seeds`` with ``--backend ray``: one Ray run per seed, each its own directory, and each the same run
    as the local backend's for that seed (a synchronous Ray run reproduces the local one)."""
    import csv

    from orchestration.cli import main

    def rows(path) -> list[dict]:
        with open(path / "metrics.csv") as f:  # what is learned and counted, not timed
            return [{k: v for k, v in row.items() if not k.startswith("time_") and not k.endswith("_per_s")}
                    for row in csv.DictReader(f)]

    flags = ["builtin:cartpole", "--iterations", "2", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
             "--rollout.num-workers", "2", "--seeds", "0", "1", "--no-progress"]
    main(["train", *flags, "--run-dir", str(tmp_path / "local")])
    main(["train", *flags, "--run-dir", str(tmp_path / "ray"), "--backend", "ray", "--ray.worker-num-cpus", "0",
          "--ray.learner-num-cpus", "0"])
    for seed in (0, 1):
        local, remote = rows(tmp_path / "local" / f"seed_{seed}"), rows(tmp_path / "ray" / f"seed_{seed}")
        assert len(remote) == 2 and [{k: row.get(k) for k in local[0]} for row in remote] == local, seed
    assert rows(tmp_path / "ray" / "seed_0") != rows(tmp_path / "ray" / "seed_1")  # each run had its own seed


def test_a_trainer_built_from_python_warns_of_settings_it_does_not_use_and_the_cli_says_them_once(tmp_path, capsys):
    """From Python, ``build_trainer`` warns (``UnusedSettingWarning``) where the CLI notes on stderr: the Ray
    backend's settings on a local run were ignored without a word. The CLI says each once, with no warning."""
    import warnings

    from orchestration.builder import build_trainer
    from orchestration.cli import main
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig
    from orchestration.run_notes import UnusedSettingWarning

    small = RolloutConfig(num_envs=2, fragment_length=8)
    with pytest.warns(UnusedSettingWarning) as caught:
        build_trainer(TrainConfig(rollout=small, ray=RayConfig(num_cpus=4, learners_per_policy=2))).close()
    assert [str(w.message) for w in caught] == [
        "--ray.num-cpus, --ray.learners-per-policy apply to --backend ray only; this run is local and does not use "
        "them"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)  # a used setting: nothing to warn of
        build_trainer(TrainConfig(rollout=small, mode="async", max_staleness=2)).close()
        main(["train", *ARGS, "--iterations", "1", "--run-dir", str(tmp_path / "run"), "--no-progress",
              "--ray.num-cpus", "4"])  # the CLI's note, not a warning (which would raise here)
    assert capsys.readouterr().err.count("--ray.num-cpus applies to --backend ray only") == 1
    # resumed: the settings come from the checkpoint, not from the user now (a Ray run resumed with --backend
    # local was told of Ray settings it had not typed); a flag changing one is news again
    main(["train", "--resume", "--run-dir", str(tmp_path / "run"), "--iterations", "2", "--no-progress"])
    assert "--ray.num-cpus" not in capsys.readouterr().err
    main(["train", "--resume", "--run-dir", str(tmp_path / "run"), "--iterations", "3", "--no-progress",
          "--ray.num-cpus", "2"])
    assert capsys.readouterr().err.count("--ray.num-cpus applies to --backend ray only") == 1


def test_a_resume_with_central_inference_says_its_sampling_stream_is_drawn_afresh(tmp_path, monkeypatch, capsys):
    """Local central inference resumes every env's state; what a checkpoint lacks is the service's generator. The
    note said envs that cannot save their state were reset (built-in envs save theirs)."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", *ARGS, "--rollout.central-inference", "--iterations", "1", "--run-dir", "run"])
    capsys.readouterr()
    main(["train", "--resume", "--run-dir", "run", "--iterations", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert "not bit-identical to an uninterrupted run: the central inference service's sampling stream is not saved" \
           in err and "cannot save their state" not in err


def test_a_resume_says_what_it_cannot_continue_for_each_kind_of_run():
    """An external run's counters restarted after a resume with nothing said (its note blamed envs' state); a run
    with two reasons named only the first."""
    from orchestration.config import RolloutConfig, TrainConfig
    from orchestration.external_fleet import ExternalFleet
    from orchestration.fleet import resume_gaps

    assert ExternalFleet.resume_gaps[0].startswith("an external run's open episodes are not checkpointed, and its "
                                                   "server's counters")
    assert [g.split(":")[0] for g in resume_gaps(TrainConfig(env="CartPole-v1", mode="async"), True, 0)] == [
        "asynchronous mode"]
    central = TrainConfig(env="CartPole-v1", rollout=RolloutConfig(central_inference=True))
    assert [g[:28] for g in resume_gaps(central, False, 1)] == [
        "the central inference servic", "envs that cannot save their ", "a rollout worker was re-crea"]
    assert resume_gaps(TrainConfig(env="CartPole-v1"), True, 0) == []


def test_a_resume_names_every_reason_it_is_not_exact(tmp_path, monkeypatch, capsys):
    """Central inference over gymnasium envs (which cannot save their state): the note named only the service."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    main(["train", "CartPole-v1", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
          "--rollout.central-inference", "--iterations", "1", "--run-dir", "run", "--no-progress"])
    capsys.readouterr()
    main(["train", "--resume", "--run-dir", "run", "--iterations", "2", "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert ("not bit-identical to an uninterrupted run: the central inference service's sampling stream is not saved "
            "(actions are drawn afresh), and envs that cannot save their state were reset") in err


def test_a_fleet_that_keeps_no_worker_state_names_its_own_reason_only():
    """An external or asynchronous fleet saves no worker state, so a restore finds none: its resume note also
    blamed a re-created worker, which there never was."""
    from orchestration.config import TrainConfig
    from orchestration.envs import make_env
    from orchestration.external_fleet import ExternalFleet
    from orchestration.trainer import Trainer

    class Fleet:  # what the trainer reads of an external fleet here (a small fake: the test is about the note)
        resume_gaps, reported = ExternalFleet.resume_gaps, {}

        def state(self) -> list:
            return []

        def broadcast(self, *args, **kwargs) -> None:
            pass

    trainer = Trainer(TrainConfig(), Fleet(), {}, None, make_env("builtin:cartpole", 1).tree)
    trainer.load_state_({"iteration": 3, "env_steps": 96, "history": {}, "actors": [], "learners": {}})
    assert trainer.resume_gaps == list(ExternalFleet.resume_gaps) and not trainer.resume_exact


def test_config_fields_named_as_flags_say_each_flag_once():
    from orchestration.user_errors import as_flags

    assert as_flags("TeamCriticConfig.lr (--team-critic.lr) must be > 0") == "--team-critic.lr must be > 0"
    assert as_flags("PolicyConfig.recurrent_critic must be False") == "--policy.recurrent-critic must be False"


def test_a_resumed_run_drops_the_previous_segments_final_accounting(tmp_path):
    """A resumed run that then crashes wrote no tally of its own: run.json kept the earlier one, labelled final."""
    from orchestration.run_loop import record_final_accounting, write_provenance

    write_provenance(tmp_path, False)
    record_final_accounting(tmp_path, {"fragments_produced": 3})
    assert json.loads((tmp_path / "run.json").read_text())["final_accounting"] == {"fragments_produced": 3}
    write_provenance(tmp_path, True)
    record = json.loads((tmp_path / "run.json").read_text())
    assert "final_accounting" not in record and len(record["resumes"]) == 1
