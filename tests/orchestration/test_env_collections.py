"""Environment collections in training (issue 14), local backend: members switched per actor at fragment
boundaries, env ids on every fragment, per-env metrics, curriculum promotion, splits, adversarial sets,
priors drawn per episode, tree checks, checkpoints and the CLI flag."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from core.envsets import EnvCollection
from core.losses import PPOConfig
from orchestration.builder import build_trainer
from orchestration.collection_driver import CollectionDriver
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.collection_env import make_actor_env
from orchestration.env_collection import load_collection
from orchestration.run_state import restore_trainer_, trainer_state

FORMAT = "shoal.envcollection/1"
ROOT = Path(__file__).resolve().parents[2]


def cartpole(max_steps: int) -> dict:
    return {"env": "builtin:cartpole", "kwargs": {"max_steps": max_steps}}


def curriculum(threshold: float) -> str:
    return json.dumps({"format": FORMAT, "members": {"easy": cartpole(50), "hard": cartpole(500)},
                       "structure": {"kind": "curriculum", "stages": ["easy", "hard"], "edges": [["easy", "hard"]],
                                     "metric": "mean_return", "threshold": threshold}})


def config(collection: str, *, workers: int = 2, num_envs: int = 4, fragment_length: int = 16, **kw) -> TrainConfig:
    return TrainConfig(collection=collection, seed=kw.pop("seed", 0), lr=1e-3, ppo=PPOConfig(minibatch_size=64),
                       rollout=RolloutConfig(num_envs=num_envs, fragment_length=fragment_length, num_workers=workers),
                       **kw)


def run(cfg: TrainConfig, iterations: int):
    """Trains; returns every iteration's metrics, the members assigned and the metadata of the fragments."""
    trainer = build_trainer(cfg)
    metas: list[dict] = []
    for learner in trainer.fleet.learners.values():
        receive = learner.receive
        learner.receive = lambda fragment, meta, receive=receive: (metas.append(meta), receive(fragment, meta))[1]
    out = []
    try:
        for _ in range(iterations):
            start = len(metas)
            metrics = trainer.train()
            out.append((metrics, list(trainer.envsets.assigned), metas[start:]))
    finally:
        trainer.close()
    return out


def test_a_curriculum_promotes_exactly_when_the_threshold_is_met_and_every_fragment_names_its_env():
    for threshold in (0.5, 16.0):
        unlocked_before = False
        met = False
        for metrics, assigned, metas in run(config(curriculum(threshold)), 4):
            # each worker's fragments name the member it was given; per-env metrics cover every member
            assert metas and all(m["env_id"] == assigned[m["worker_id"]] for m in metas)
            assert "episode_return_mean/env:easy" in metrics and "episode_return_mean/env:hard" in metrics
            assert metrics["collection/fragments/env:easy"] + metrics["collection/fragments/env:hard"] == len(metas)
            if not unlocked_before:
                assert set(assigned) == {"easy"}  # a locked stage is never drawn
            met = met or (metrics["episodes/env:easy"] > 0 and metrics["episode_return_mean/env:easy"] >= threshold)
            unlocked = metrics["collection/unlocked/env:hard"] == 1.0
            assert unlocked == met, (threshold, metrics["episode_return_mean/env:easy"])  # exactly then
            unlocked_before = unlocked
        assert unlocked_before, f"threshold {threshold} was met in the run (the test must exercise a promotion)"
    for metrics, assigned, metas in run(config(curriculum(1e9), workers=1), 3):  # unreachable: never promoted
        assert metrics["collection/unlocked/env:hard"] == 0.0 and {m["env_id"] for m in metas} == {"easy"}


def test_asynchronous_mode_switches_members_at_each_actors_next_fragment():
    cfg = config(curriculum(0.5), mode="async", max_staleness=4, train_batch_size=128)
    drawn = set()
    for metrics, assigned, metas in run(cfg, 4):
        assert metas and all(m["env_id"] == assigned[m["worker_id"]] for m in metas)  # local actors switch at once
        assert metrics["episodes/env:easy"] + metrics["episodes/env:hard"] == metrics["episodes"]
        drawn |= set(assigned)
    assert drawn == {"easy", "hard"}


def _fake_episodes(returns: dict[str, list[float]]) -> dict[str, list]:
    out: dict[str, list] = {"return": [], "length": []}
    for env_id, values in returns.items():
        out[f"env:{env_id}/return"] = list(values)
        out[f"env:{env_id}/length"] = [1.0] * len(values)
        out[f"env:{env_id}/fragments"] = [1.0]
    return out


def test_promotion_is_driven_by_the_reported_metric_at_the_threshold_itself():
    driver = CollectionDriver(load_collection(config(curriculum(10.0))), num_actors=4, seed=0)
    driver.observe_(_fake_episodes({"easy": [9.0, 10.999]}))  # mean 9.9995 < 10
    assert driver.state.unlocked == {"easy"} and set(driver.draw_()) == {"easy"}
    metrics = driver.observe_(_fake_episodes({"easy": [10.001]}))  # window mean now exactly 10.0
    assert metrics["episode_return_mean/env:easy"] == 10.0
    assert driver.state.unlocked == {"easy", "hard"} and driver.state.mastered == {"easy"}


def test_an_adversarial_set_trains_most_on_the_env_with_the_lowest_return():
    doc = {"format": FORMAT, "members": {"short": cartpole(5), "long": cartpole(500)},
           "structure": {"kind": "adversarial", "ids": ["short", "long"], "temperature": 0.25}}
    # deterministic fake metrics: the driver's draws follow softmax(-normalised return / T)
    driver = CollectionDriver(EnvCollection.from_json(json.dumps(doc)), num_actors=2000, seed=1)
    driver.observe_(_fake_episodes({"short": [1.0], "long": [30.0]}))
    share = driver.draw_().count("short") / 2000
    assert abs(share - 1 / (1 + math.exp(-4))) < 0.02
    # a real run: 'short' episodes end at 5 steps, 'long' ones later, so 'short' has the lowest return
    drawn = {"short": 0, "long": 0}
    for i, (metrics, assigned, _) in enumerate(run(config(json.dumps(doc), num_envs=8, fragment_length=32), 6)):
        if i >= 2:  # both measured
            assert metrics["collection/prob/env:short"] > 0.9
            for env_id in assigned:
                drawn[env_id] += 1
    assert drawn["short"] > 3 * drawn["long"], drawn


def test_a_split_trains_on_train_envs_and_evaluates_only_on_test_envs():
    doc = json.dumps({"format": FORMAT, "members": {"a": cartpole(40), "b": cartpole(60), "test": cartpole(100)},
                      "structure": {"kind": "split", "train": ["a", "b"], "test": ["test"]}})
    trainer = build_trainer(config(doc, eval_every=1, eval_episodes=3))
    try:
        for _ in range(3):
            metrics = trainer.train()
            assert set(trainer.envsets.assigned) <= {"a", "b"} and metrics["episodes/env:test"] == 0
            evals = {k for k in metrics if k.startswith("eval_return_mean")}
            assert evals == {"eval_return_mean", "eval_return_mean/env:test"}
            assert metrics["eval_return_mean"] == metrics["eval_return_mean/env:test"]
        assert set(trainer.evaluator.env._envs) == {"test"}  # no train env was ever built for evaluation
    finally:
        trainer.close()


def prior(member: str | dict = "builtin:cartpole") -> str:
    return json.dumps({"format": FORMAT, "members": {"pole": member}, "structure": {"kind": "prior", "id": "pole", "params": {
        "length": {"kind": "uniform", "low": 0.25, "high": 0.75},
        "gravity": {"kind": "normal", "mean": 9.8, "std": 0.5},
        "force_mag": {"kind": "choice", "values": [5.0, 20.0], "probs": [0.25, 0.75]}}}})


def test_prior_parameters_are_drawn_per_episode_reach_the_env_and_follow_the_declared_distribution():
    env = make_actor_env(config(prior()), 64)
    env.reset(seed=3)
    cartpole_env = env._envs["pole"]
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):  # random actions: episodes end after ~20 steps, each reset row draws anew
        out = env.step(_actions(64, generator))
    drawn = env.pop_report_()["params"]
    n = len(drawn["length"])
    assert n > 64 * 8  # per episode, not per env
    assert stats.kstest(drawn["length"].numpy(), "uniform", args=(0.25, 0.5)).pvalue > 0.01
    assert stats.kstest(drawn["gravity"].numpy(), "norm", args=(9.8, 0.5)).pvalue > 0.01
    share = float((drawn["force_mag"] == 20.0).double().mean())
    assert abs(share - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n)
    # each row's current parameters drive its dynamics: one push from rest (gymnasium's equations at theta 0)
    params = cartpole_env.params
    assert set(params["force_mag"].tolist()) == {5.0, 20.0} and params["length"].unique().numel() == 64
    cartpole_env.state = torch.zeros(64, 4)
    out = env.step(_actions(64, generator, value=1))
    mass, pole, length = params["masscart"] + params["masspole"], params["masspole"], params["length"]
    temp = params["force_mag"] / mass
    theta_acc = -temp / (length * (4 / 3 - pole / mass))
    x_acc = temp - pole * length * theta_acc / mass
    torch.testing.assert_close(out["next", "agent", "observation"][:, 0, 1], 0.02 * x_acc)
    torch.testing.assert_close(out["next", "agent", "observation"][:, 0, 3], 0.02 * theta_acc)
    env.close()


def _actions(n: int, generator: torch.Generator, value: int | None = None):
    from tensordict import TensorDict

    action = torch.full((n, 1), value) if value is not None else torch.randint(2, (n, 1), generator=generator)
    return TensorDict({"agent": TensorDict({"action": action}, [n, 1])}, [n])


def test_a_prior_in_training_reports_its_draws_and_is_refused_for_envs_without_per_episode_parameters():
    metrics, _, metas = run(config(prior(), workers=1), 2)[-1]
    assert {m["env_id"] for m in metas} == {"pole"}
    assert 0.25 <= metrics["collection/param/length_mean"] <= 0.75 and metrics["episodes/env:pole"] > 0
    with pytest.raises(ValueError, match=r"member 'pole' \(env 'builtin:spread'\) cannot take per-episode "
                                         r"parameters.*builtin:cartpole \(gravity"):
        build_trainer(config(prior("builtin:spread")))
    with pytest.raises(ValueError, match=r"member 'pole' \(env 'builtin:cartpole'\) draws its prior's per-episode "
                                         r"parameters in the actor's process only.*drop those flags"):
        build_trainer(TrainConfig(collection=prior(), rollout=RolloutConfig(num_envs=4, env_processes=2)))


def test_members_with_different_trees_are_refused_naming_both_ids_and_the_first_differing_key():
    doc = {"format": FORMAT, "members": {"small": {"env": "builtin:spread", "kwargs": {"capacity": 2}},
                                         "large": {"env": "builtin:spread", "kwargs": {"capacity": 3}}},
           "structure": {"kind": "split", "train": ["small"], "test": ["large"]}}
    with pytest.raises(ValueError, match=r"'small' \(builtin:spread\) and 'large' \(builtin:spread\) have different "
                                         r"trees: first difference at 'array.template.observation.shape'"):
        build_trainer(config(json.dumps(doc)))
    doc["members"]["large"] = "builtin:cartpole"
    with pytest.raises(ValueError, match=r"'small' \(builtin:spread\) and 'large' \(builtin:cartpole\)"):
        build_trainer(config(json.dumps(doc)))
    doc["members"]["large"] = {"env": "builtin:spread", "kwargs": {"capcity": 2}}  # a key of the file, not a flag
    with pytest.raises(ValueError, match=r"^collection env 'large': env 'builtin:spread': kwargs capcity is not a "
                                         r"keyword it takes \(did you mean 'capacity'\?\)"):
        build_trainer(config(json.dumps(doc)))


@pytest.mark.parametrize("which", ["curriculum", "prior"])
def test_a_checkpoint_round_trip_resumes_the_collection_state_exactly(which):
    cfg = config(curriculum(16.0)) if which == "curriculum" else config(prior(), workers=1)
    whole = [(m, a) for m, a, _ in run(cfg, 5)]
    trainer = build_trainer(cfg)
    for _ in range(2):
        trainer.train()
    weights, tensors, state = trainer_state(trainer)
    trainer.close()
    assert state["config"]["collection"] == load_collection(cfg).to_json() and "rng/collection" in tensors
    resumed = build_trainer(cfg)
    restore_trainer_(resumed, weights, tensors, json.loads(json.dumps(state)))
    assert resumed.envsets.state == trainer.envsets.state
    try:
        for metrics, assigned in whole[2:]:
            again = resumed.train()
            assert resumed.envsets.assigned == assigned
            for key in [k for k in metrics if "env:" in k or k.startswith("collection/")]:
                assert again[key] == metrics[key] or (math.isnan(again[key]) and math.isnan(metrics[key])), key
    finally:
        resumed.close()


def test_a_collection_is_read_from_json_or_yaml_files_and_a_document_never_imports_code(tmp_path):
    doc = json.loads(curriculum(5.0))
    (tmp_path / "c.json").write_text(json.dumps(doc))
    yaml_text = "format: shoal.envcollection/1\nmembers: {easy: builtin:cartpole, hard: builtin:cartpole}\n" \
                "structure: {kind: curriculum, stages: [easy, hard], edges: [[easy, hard]], metric: mean_return, " \
                "threshold: 5}\n"
    (tmp_path / "c.yaml").write_text(yaml_text)
    for name in ("c.json", "c.yaml"):
        assert load_collection(TrainConfig(collection=str(tmp_path / name))).ids == ("easy", "hard")
    with pytest.raises(ValueError, match="expected a .json or .yaml file"):
        load_collection(TrainConfig(collection=str(tmp_path / "c.txt")))
    doc["members"]["hard"] = "mymodule:make_env"
    (tmp_path / "code.json").write_text(json.dumps(doc))
    assert load_collection(TrainConfig(collection=str(tmp_path / "code.json"))).member("hard").env == "mymodule:make_env"
    with pytest.raises(ValueError, match=r"member 'hard' names env 'mymodule:make_env'.*never imports code"):
        load_collection(TrainConfig(collection=json.dumps(doc)))  # a document, as a checkpoint stores it
    doc["members"]["hard"] = "builtin:cartpole"
    doc["structure"]["metric"] = "win_rate"
    with pytest.raises(ValueError, match="metric 'win_rate' is not reported per env; one of: mean_return"):
        load_collection(TrainConfig(collection=json.dumps(doc)))


@pytest.mark.slow
def test_the_cli_trains_on_a_collection_file_and_resumes_without_it(tmp_path):
    collection = tmp_path / "collection.json"
    collection.write_text(curriculum(5.0))
    run_dir = tmp_path / "run"
    common = [sys.executable, "-m", "orchestration.cli", "train", "--run-dir", str(run_dir), "--no-progress",
              "--loggers", "csv", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
              "--ppo.minibatch-size", "32"]
    first = subprocess.run([*common, "--collection", str(collection), "--iterations", "2"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "episode_return_mean/env:easy" in header and "collection/unlocked/env:hard" in header
    collection.unlink()  # the checkpoint holds the document
    resumed = subprocess.run([*common, "--resume", "--iterations", "3"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 4 and np.isfinite(float(rows[-1].split(",")[header.index("episodes/env:easy")]))


def test_shoal_evaluate_plays_every_evaluation_env_of_a_collection_checkpoint(tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    doc = json.dumps({"format": FORMAT, "members": {"a": cartpole(40), "t1": cartpole(30), "t2": cartpole(60)},
                      "structure": {"kind": "split", "train": ["a"], "test": ["t1", "t2"]}})
    monkeypatch.chdir(tmp_path)
    main(["train", "--collection", doc, "--iterations", "1", "--rollout.num-envs", "4", "--rollout.fragment-length",
          "16", "--ppo.minibatch-size", "32", "--loggers", "csv", "--run-dir", "run", "--no-progress"])
    capsys.readouterr()
    main(["evaluate", "run/checkpoints", "--episodes", "3", "--num-envs", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for env_id, cap in (("t1", 30), ("t2", 60)):
        assert 0 < out[f"eval_return_mean/env:{env_id}"] <= cap and f"eval_return_std/env:{env_id}" in out
    assert "eval_return_mean/env:a" not in out
    assert out["eval_return_mean"] == pytest.approx((out["eval_return_mean/env:t1"] + out["eval_return_mean/env:t2"]) / 2)
    # --env names the env to play, even the one the run's config kept beside its collection (CartPole-v1)
    main(["evaluate", "run/checkpoints", "--episodes", "2", "--num-envs", "2", "--env", "CartPole-v1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["episodes"] == 2 and not any("/env:" in key for key in out)

    import dataclasses

    import orchestration.run_state as run_state

    code = json.loads(doc)
    code["members"]["t2"] = "mymodule:make_env"  # a checkpoint whose stored document names code to import
    stored = run_state.load_config
    monkeypatch.setattr(run_state, "load_config",
                        lambda state: dataclasses.replace(stored(state), collection=json.dumps(code)))
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", "run/checkpoints", "--episodes", "1"])
    assert exit_info.value.code == 2
    assert "member 't2' names env 'mymodule:make_env'" in capsys.readouterr().err


def test_set_env_ids_on_a_run_without_a_collection_or_with_one_id_short_is_named():
    """The Fleet loop's ``set_env_ids`` line is for collections: without one it says so; with one, a list of the
    wrong length says how many it takes (a bare AttributeError and zip's ValueError before)."""
    plain = build_trainer(TrainConfig(env="builtin:cartpole", rollout=RolloutConfig(num_envs=2, fragment_length=4)))
    with pytest.raises(ValueError, match=r"cannot switch to collection members \['easy'\]: this run's env "
                                         r"\(builtin:cartpole\) is not a collection \(a run of one is built with "
                                         r"--collection FILE\)"):
        plain.fleet.set_env_ids(["easy"])
    plain.close()
    two = build_trainer(TrainConfig(collection=curriculum(100.0), rollout=RolloutConfig(num_envs=2, fragment_length=4,
                                                                                        num_workers=2)))
    with pytest.raises(ValueError, match=r"set_env_ids takes one collection member per worker \(2\), got 1: "
                                         r"\['hard'\]"):
        two.fleet.set_env_ids(["hard"])
    two.fleet.set_env_ids(["hard", "easy"])
    two.close()
