"""Datasets (record, save, load, refuse) and behaviour cloning from them, then PPO starting from the clone."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.layout import ACTION, EPISODE_ID, LOG_PROB, OBSERVATION
from core.losses import PPOConfig
from core.losses.bc import BCConfig
from core.policies import PolicyConfig, make_policies
from core.specs import to_json
from orchestration.dataset_learner import BCLearner, actor_log_prob, pretrain_, run_steps, start_from_
from orchestration.datasets import (Dataset, DatasetError, check_tree, load_dataset, record_dataset,
                                    save_dataset)
from orchestration.learner import PPOLearner

ENV, KWARGS = "builtin:cartpole", {"max_steps": 200}


def lean(step):
    """Push toward the pole's lean (angle plus half its angular velocity): holds CartPole up for 500 steps."""
    obs = step.get(("agent", OBSERVATION))
    return {"agent": {ACTION: (obs[..., 2] + 0.5 * obs[..., 3] > 0).long()}}


def evaluate(policy, episodes: int = 8, seed: int = 1) -> float:
    """Mean return of ``policy`` acting with its mode."""
    return float(record_dataset(policy, ENV, episodes, seed=seed, env_kwargs=KWARGS,
                                deterministic=True).episode_returns().mean())


@pytest.fixture(scope="module")
def scripted() -> Dataset:
    return record_dataset(lean, ENV, 16, seed=0, env_kwargs=KWARGS, source="scripted:lean")


@pytest.fixture
def saved(scripted, tmp_path):
    return save_dataset(tmp_path / "lean", scripted)


def fresh_policy(tree, seed: int = 0):
    torch.manual_seed(seed)
    return make_policies(tree)["agent"]


def test_cloning_a_scripted_controller_reaches_its_return_and_ppo_starts_from_it(scripted):
    teacher = float(scripted.episode_returns().mean())
    assert teacher >= 195 and scripted.episodes == 16 and scripted.steps == 16 * 200
    policy = fresh_policy(scripted.tree)
    assert evaluate(policy) < 0.5 * teacher  # the untrained policy does not already balance the pole
    learner = BCLearner(policy, scripted, config=BCConfig(lr=3e-3), seed=0)
    reports = list(learner.run(steps=300, report_every=100))
    assert reports[-1]["loss_bc"] < reports[0]["loss_bc"]
    clone = learner.actor_policy()
    assert evaluate(clone) >= 0.9 * teacher

    ppo = PPOLearner(fresh_policy(scripted.tree, seed=3), {"agent": None}, ppo=PPOConfig(), lr=3e-4, batch_steps=64)
    assert evaluate(ppo.actor_policy()) < 0.5 * teacher
    assert start_from_(ppo, learner.published()[1]) == 1
    version, weights = ppo.published()
    assert version == 1 and all(torch.equal(weights[k], v) for k, v in learner.published()[1].items(True, True))
    assert evaluate(ppo.actor_policy()) >= 0.9 * teacher


def test_pretrain_trains_the_module_in_place(scripted):
    policy = fresh_policy(scripted.tree)
    before = policy.actor_out.weight.detach().clone()
    reports = pretrain_(policy, scripted, BCConfig(lr=3e-3), steps=20, report_every=10)
    assert [r["train_steps"] for r in reports] == [10, 20]
    assert not torch.equal(before, policy.actor_out.weight)


def test_dataset_round_trips_exactly(scripted, saved):
    loaded = load_dataset(saved)
    assert (loaded.env, loaded.source, loaded.steps, loaded.episodes) == (ENV, "scripted:lean", 3200, 16)
    assert to_json(loaded.tree) == to_json(scripted.tree)
    check_tree(loaded, scripted.tree)
    keys = set(scripted.data.keys(True, True))
    assert set(loaded.data.keys(True, True)) == keys
    for key in keys:
        a, b = scripted.data.get(key), loaded.data.get(key)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert loaded.data.get(("agent", OBSERVATION)).shape == (3200, 1, 4)
    torch.testing.assert_close(loaded.episode_returns(), scripted.episode_returns())
    with pytest.raises(FileExistsError):
        save_dataset(saved, scripted)


def _tamper(path, change) -> None:
    tensors = load_file(str(path / "tensors.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "tensors.safetensors"))


def _set(key, value_of):
    return lambda t: t.__setitem__(key, value_of(t))


def _illegal(t):
    t["agent.action_mask"] = t["agent.action_mask"].clone()
    t["agent.action_mask"][5, 0, t["agent.action"][5, 0]] = False


@pytest.mark.parametrize("change, key, message", [
    (_set("agent.observation", lambda t: t["agent.observation"][..., :3].contiguous()), "agent.observation", "shape"),
    (_set("agent.observation", lambda t: t["agent.observation"].double()), "agent.observation", "torch.float64"),
    (_set("agent.action", lambda t: t["agent.action"].int()), "agent.action", "torch.int32"),
    (_set("agent.bogus", lambda t: torch.zeros(3200)), "agent.bogus", "unknown key"),
    (lambda t: t.pop("next.agent.reward"), "next.agent.reward", "missing"),
    (_set("agent.action", lambda t: t["agent.action"].clone().fill_(2)), "agent/action", "bounds|outside|range"),
    (_illegal, "agent.action", "illegal"),
    (_set(EPISODE_ID, lambda t: t[EPISODE_ID].flip(0).contiguous()), EPISODE_ID, "episode ids"),
    (_set("next.truncated", lambda t: torch.zeros_like(t["next.truncated"])), "next.terminated", "last step"),
    (_set("agent.observation", lambda t: t["agent.observation"].clone().fill_(torch.nan)), "agent.observation", "NaN"),
])
def test_malformed_tensors_are_refused_naming_file_and_key(saved, change, key, message):
    _tamper(saved, change)
    with pytest.raises(DatasetError, match=message) as caught:
        load_dataset(saved)
    assert caught.value.file.endswith("tensors.safetensors") and key in str(caught.value)


def _header(path, edit) -> None:
    header = json.loads((path / "dataset.json").read_text())
    edit(header)
    (path / "dataset.json").write_text(json.dumps(header))


@pytest.mark.parametrize("write, key, message", [
    (lambda p: (p / "dataset.json").write_bytes(pickle.dumps({"format": "shoal.dataset/1"})), None, "not a JSON"),
    (lambda p: _header(p, lambda h: h.update(format="shoal.dataset/0")), "format", "format must be"),
    (lambda p: _header(p, lambda h: h.update(extra=1)), "extra", "unknown header field"),
    (lambda p: _header(p, lambda h: h.update(episodes=15)), "episodes", "says 15"),
    (lambda p: _header(p, lambda h: h.update(steps="3200")), "steps", "must be an int"),
    (lambda p: _header(p, lambda h: h.update(tree="{}")), "tree", "not a tree"),
    (lambda p: (p / "tensors.safetensors").write_bytes(b"\x80\x04garbage"), None, "unreadable safetensors"),
    (lambda p: os.remove(p / "tensors.safetensors"), None, "missing"),
])
def test_malformed_headers_and_files_are_refused(saved, write, key, message):
    write(saved)
    with pytest.raises(DatasetError, match=message) as caught:
        load_dataset(saved)
    assert str(saved) in caught.value.file and (key is None or caught.value.key == key)


def test_a_symbolic_link_is_refused(saved, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(saved)
    with pytest.raises(DatasetError, match="symbolic link"):
        load_dataset(link)


def test_saving_refuses_malformed_data(scripted, tmp_path):
    bad = Dataset(scripted.data.exclude(("next", "agent", "reward")), scripted.tree, ENV)
    with pytest.raises(DatasetError, match="next.agent.reward"):
        save_dataset(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()


def test_run_stops_at_its_budget_or_its_condition(scripted):
    learner = BCLearner(fresh_policy(scripted.tree), scripted, config=BCConfig(minibatch_size=64), seed=0)
    reports = list(learner.run(steps=7, report_every=3))
    assert [r["run_steps"] for r in reports] == [3, 6, 7]
    assert learner.counters["train_steps"] == 7 and learner.version == 7 and learner.published()[0] == 7
    reports = list(learner.run(until=lambda m: m["train_steps"] >= 11, report_every=2))
    assert [r["train_steps"] for r in reports] == [9, 11]
    assert list(learner.run(steps=0)) == []
    with pytest.raises(ValueError):
        next(run_steps(learner.train_step, steps=-1))


def test_state_resumes_the_same_minibatches(scripted):
    a = BCLearner(fresh_policy(scripted.tree), scripted, config=BCConfig(minibatch_size=1000), seed=3)
    *_, _ = a.run(steps=5)  # mid-epoch: the permutation and its position are part of the state
    b = BCLearner(fresh_policy(scripted.tree, seed=9), scripted, config=BCConfig(minibatch_size=1000), seed=0)
    b.load_state_(a.state())
    for _ in range(3):
        ma, mb = a.train_step(), b.train_step()
        assert ma["loss_bc"].item() == mb["loss_bc"].item()
    assert all(torch.equal(x, y) for x, y in zip(a.policy.parameters(), b.policy.parameters()))
    assert b.report()["learner"]["train_steps"] == 8 and b.report()["dataset"]["episodes"] == 16


def test_recorded_log_probs_are_the_policys_and_the_actor_path_matches_evaluate(scripted):
    policy = fresh_policy(scripted.tree)
    data = record_dataset(policy, ENV, 4, seed=5, env_kwargs=KWARGS).data
    group = data.get("agent")
    log_prob, _ = actor_log_prob(policy, group)
    torch.testing.assert_close(group.get(LOG_PROB), log_prob.detach())
    torch.testing.assert_close(log_prob, policy.evaluate_terms(group)[LOG_PROB])


def test_policy_groups_must_be_in_the_dataset_and_weights_must_fit(scripted):
    with pytest.raises(ValueError, match="not in the dataset"):
        BCLearner(fresh_policy(scripted.tree), scripted, groups={"nobody": None})
    ppo = PPOLearner(fresh_policy(scripted.tree), {"agent": None}, ppo=PPOConfig(), lr=3e-4, batch_steps=64)
    narrow = make_policies(scripted.tree, PolicyConfig(hidden_sizes=(32, 32)))["agent"]
    with pytest.raises(ValueError, match="do not fit"):
        start_from_(ppo, BCLearner(narrow, scripted).published()[1])
    assert ppo.version == 0


def test_shoal_train_pretrains_on_a_dataset_before_ppo(scripted, tmp_path, monkeypatch, capsys):
    import csv

    from orchestration.cli import main

    path = str(save_dataset(tmp_path / "lean", scripted))
    monkeypatch.chdir(tmp_path)
    short = ["--iterations", "1", "--rollout.num-envs", "4", "--rollout.fragment-length", "200", "--env-kwargs",
             "max_steps", "150", "--loggers", "csv", "--no-progress"]
    main(["train", ENV, "--pretrain.dataset", path, "--pretrain.steps", "300", "--pretrain.lr", "3e-3",
          "--run-dir", "cloned", *short])
    with open(tmp_path / "cloned" / "metrics.csv") as f:
        first = next(csv.DictReader(f))
    assert float(first["episode_return_mean"]) > 100  # collected with the clone's weights: random gets ~20
    config = json.loads((tmp_path / "cloned" / "config.json").read_text())
    assert config["pretrain"]["dataset"] == path and config["pretrain"]["steps"] == 300

    import orchestration.builder as builder

    def refuse(*args):
        raise AssertionError("a resumed run must not pretrain again")

    monkeypatch.setattr(builder, "pretrain_policies_", refuse)  # the checkpoint holds the trained weights
    main(["train", "--resume", "--run-dir", "cloned", "--iterations", "2", "--no-progress"])
    with open(tmp_path / "cloned" / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "builtin:spread", "--pretrain.dataset", path, "--run-dir", "wrong", *short[:6],
              "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # the dataset, both envs and where their trees part
    assert f"{path} [tree]: recorded in builtin:cartpole, whose tree differs from builtin:spread's: " in err, err
    with pytest.raises(SystemExit):  # the policy by its id and both flags (it said "policy 'policy'")
        main(["train", ENV, "--pretrain.dataset", path, "--policy.recurrent", "--run-dir", "memory", *short])
    err = capsys.readouterr().err
    assert "policy 'agent' is recurrent (--policy.recurrent): behaviour cloning here (--pretrain.dataset)" in err


@pytest.mark.ray
def test_pretraining_reaches_ray_learners_and_workers(scripted, tmp_path, ray_session):
    """The Ray backend starts from the cloned weights too: the learner actor publishes them and the rollout
    workers collect the first iteration with them."""
    from orchestration.builder import build_trainer
    from orchestration.config import PretrainConfig, RayConfig, RolloutConfig, TrainConfig

    path = str(save_dataset(tmp_path / "lean", scripted))
    config = TrainConfig(env=ENV, env_kwargs=(("max_steps", "150"),), backend="ray", iterations=1,
                         rollout=RolloutConfig(num_envs=4, fragment_length=200),
                         ray=RayConfig(learner_num_cpus=0, learner_num_gpus=0),
                         pretrain=PretrainConfig(dataset=path, steps=300, lr=3e-3))
    trainer = build_trainer(config)
    try:
        metrics = trainer.train()
    finally:
        trainer.close()
    assert metrics["episode_return_mean"] > 100, metrics["episode_return_mean"]  # random play gets ~20
