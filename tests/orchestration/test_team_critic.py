"""The team critic (orchestration/team_critic.py): one critic shared by a heterogeneous team, a learner of its own
whose values the member policies' PPO learners take for their advantages; on both backends, through a resume,
and refused by name where it cannot work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.layout import DONE, NEXT, REWARD, STATE_VALUE, TERMINATED
from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.config import CuriosityConfig, RayConfig, RolloutConfig, TrainConfig
from orchestration.team_critic_config import TeamCriticConfig

ENV, GROUP = "builtin:spread", "agents"
TEAM = (("agents_0", "a"), ("agents_1", "b"), ("agents_2", "c"))
ON = TeamCriticConfig(enabled=True)


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"env": ENV, "env_kwargs": (("capacity", "3"),), "iterations": 2, "loggers": (),
                          "rollout": RolloutConfig(num_envs=4, fragment_length=16), "policy_mapping": TEAM,
                          "team_critic": ON, **kw})


def _hand_gae(value, next_value, reward, done, terminated, gamma, lmbda):
    """The textbook backward loop over time (``[E, T]`` float64 tensors of one agent slot)."""
    advantage = torch.zeros_like(value)
    running = torch.zeros_like(value[:, 0])
    for t in reversed(range(value.shape[1])):
        delta = reward[:, t] + gamma * (1.0 - terminated[:, t]) * next_value[:, t] - value[:, t]
        running = delta + gamma * lmbda * (1.0 - done[:, t]) * running
        advantage[:, t] = running
    return advantage


def test_members_train_on_advantages_from_the_team_critics_values(monkeypatch):
    from orchestration.builder import build_trainer
    import orchestration.learner as module

    # every agent present from the start and none arrives (finish radius ~0): one mask, episodes cut at 10 steps
    env_kwargs = (("capacity", "3"), ("min_agents", "3"), ("finish_radius", "1e-9"), ("max_steps", "10"))
    trainer = build_trainer(_config(env_kwargs=env_kwargs, ppo=PPOConfig(gamma=0.9, gae_lambda=0.8)))
    critic, member = trainer.team_critic, trainer.learners["b"]  # b acts for slot 1 only
    actor = trainer.fleet.actors[0]
    fragment = actor.collect()
    meta = actor.fragment_meta(fragment)
    critic.receive(fragment, meta)
    member.receive(fragment, meta)
    values = critic.values()
    assert list(values) == [meta["fragment_id"]]
    with torch.no_grad():  # the values handed out are the critic network's, on this very fragment
        own = critic.nets[0](fragment)[GROUP]
        torch.testing.assert_close(values[meta["fragment_id"]].get((GROUP, STATE_VALUE)), own)
    seen = {}
    real = module.ppo_update_

    def spy(policy, optimizer, batch, evaluate, cfg, generator, *, group):
        seen["batch"], seen["cfg"] = batch, cfg
        return real(policy, optimizer, batch, evaluate, cfg, generator, group=group)

    monkeypatch.setattr(module, "ppo_update_", spy)
    metrics = member.train(team_values=values)
    v = values[meta["fragment_id"]]
    slot = 1
    e, t = fragment.batch_size

    def column(x):
        return x[..., slot, 0].double()

    nxt = fragment.get((NEXT, GROUP))
    expected = _hand_gae(column(v.get((GROUP, STATE_VALUE))), column(v.get((NEXT, GROUP, STATE_VALUE))),
                         column(nxt.get(REWARD)), column(nxt.get(DONE).float()), column(nxt.get(TERMINATED).float()),
                         0.9, 0.8)
    assert bool(nxt.get(DONE)[:, 9].all())  # a truncation inside the fragment: cut and bootstrapped
    trained = seen["batch"].get((GROUP, "advantage")).reshape(e, t, 3, 1)
    torch.testing.assert_close(trained[..., slot, 0].double(), expected, rtol=1e-5, atol=1e-5)
    assert bool((trained[..., [0, 2], 0] == 0).all())  # other policies' slots are not b's to train on
    assert seen["cfg"].value_coef == 0.0  # b's own critic is not trained: the team critic trains itself
    assert "explained_variance" not in metrics and "loss_policy" in metrics
    before = [p.clone() for p in critic.nets.parameters()]
    critic_metrics = critic.train()
    assert critic.version == 1 and critic_metrics["loss_value"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, critic.nets.parameters()))


def test_a_heterogeneous_team_learns_with_the_team_critic_on_the_local_backend():
    from orchestration.builder import build_trainer

    config = _config(seed=0, iterations=10, lr=3e-3, rollout=RolloutConfig(num_envs=16, fragment_length=50),
                     ppo=PPOConfig(minibatch_size=400, gamma=0.95, entropy_coef=0.01))
    trainer = build_trainer(config)
    returns, variance = [], []
    for _ in range(config.iterations):  # 10 x 800 env steps
        metrics = trainer.train()
        returns.append(metrics["episode_return_mean"])
        variance.append(metrics["team_critic/explained_variance"])
    trainer.close()
    print(returns, variance)
    assert metrics["team_critic/version"] == config.iterations
    assert sum(returns[-3:]) / 3 > returns[0] + 2.0, returns  # from about -13 to about -9 (seed 0)
    assert sum(variance[-3:]) / 3 > 0.2, variance  # the shared critic explains the team's returns (~0.31; ~0 untrained)


@pytest.mark.ray
def test_the_ray_backend_trains_the_same_team_critic_as_the_local_one(ray_session):
    from orchestration.builder import build_trainer

    local = build_trainer(_config())
    remote = build_trainer(_config(backend="ray", ray=RayConfig(worker_num_cpus=0.25, learner_num_cpus=0.25)))
    try:
        for iteration in range(1, 3):
            a, b = local.train(), remote.train()
            assert b["team_critic/version"] == iteration
            for key in ("team_critic/loss_value", "a/loss_policy", "b/loss_policy", "c/loss_policy"):
                assert a[key] == b[key], key  # the values reached the Ray learners as they reach the local ones
            assert "a/explained_variance" not in b  # a member trained on the team critic's values
        state, mine = remote.team_critic.state(), local.team_critic.state()
        assert state["version"] == 2 and state["inbox"]["ledger"]["0"]["accepted"] == 2
        assert all((state["weights"][k] == v).all() for k, v in mine["weights"].items())  # the same critic
        remote.team_critic.load_state_(dict(mine, version=7))
        assert remote.team_critic.state()["version"] == 7
    finally:
        local.close()
        remote.close()


def _cli(run_dir, *extra: str) -> dict:
    from orchestration.cli import train

    return train([ENV, "--env-kwargs", "capacity", "3", "--policy-mapping", *(x for pair in TEAM for x in pair),
                  "--team-critic.enabled", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
                  "--loggers", "csv", "--no-progress", "--run-dir", str(run_dir), *extra])


def test_shoal_train_resume_continues_the_team_critic(tmp_path):
    from orchestration.builder import build_trainer
    from orchestration.checkpoint import load_checkpoint
    from orchestration.run_state import load_config, restore_trainer_

    _cli(tmp_path, "--iterations", "2")
    weights, tensors, state = load_checkpoint(tmp_path / "checkpoints")
    assert state["team_critic"]["version"] == 2 and "rng/team_critic" in tensors
    trainer = build_trainer(load_config(state))  # what --resume does
    restore_trainer_(trainer, weights, tensors, state)
    restored = trainer.team_critic.state()
    trainer.close()
    saved = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith("team_critic/weights/")}
    assert saved.keys() == restored["weights"].keys()
    assert all(torch.equal(saved[k], torch.as_tensor(v)) for k, v in restored["weights"].items())
    moments = {k: v for k, v in restored["optimizer"][0].items() if k.endswith("exp_avg_sq")}
    assert moments and all(torch.equal(tensors[f"team_critic/{k}"], torch.as_tensor(v)) for k, v in moments.items())
    resumed = _cli(tmp_path, "--iterations", "3", "--resume")
    assert resumed["team_critic/version"] == 3  # one more step of the restored critic (a fresh one would be at 1)


def test_state_round_trips_into_a_fresh_critic():
    from orchestration.builder import build_trainer

    trainer = build_trainer(_config(iterations=1))
    trainer.train()
    fresh = build_trainer(_config(iterations=1, seed=1)).team_critic
    state = trainer.team_critic.state()
    assert any(not torch.equal(torch.as_tensor(v), fresh.nets.state_dict()[k]) for k, v in state["weights"].items())
    fresh.load_state_(state)
    again = fresh.state()
    assert again["version"] == 1 and again["counters"] == state["counters"] and again["inbox"] == state["inbox"]
    for part in ("weights",):
        assert all((again[part][k] == v).all() for k, v in state[part].items())
    assert all((again["optimizer"][0][k] == v).all() for k, v in state["optimizer"][0].items())
    assert (again["generator"] == state["generator"]).all()


@pytest.mark.parametrize("change, message", [
    ({"mode": "async"}, r"--team-critic.enabled needs --mode sync"),
    ({"policy_mapping": ()}, r"--team-critic.enabled: the env has no team .*population '\(root\)' \(cooperative, "
                             r"groups \['agents'\], learning policies \['agents'\]\).*--policy.critic central"),
    ({"policy_mapping": (("agents_0", "a"), ("agents_1", "random"), ("agents_2", "random"))},
     r"learning policies \['a'\]\).*--policy-mapping agents_0 a agents_1 b"),
    ({"env": "pettingzoo:classic.connect_four_v3", "env_kwargs": (), "policy_mapping": ()},  # named agents_0 too
     r"\(zero_sum, .*this env has none\.$"),
    ({"curiosity": CuriosityConfig(coef=0.5)}, r"--team-critic.enabled cannot be combined with --curiosity.coef"),
    ({"policy": PolicyConfig(recurrent=True, recurrent_critic=True)}, r"drop --policy.recurrent-critic"),
    ({"policy": PolicyConfig(scale_rewards=True)}, r"--policy.scale-rewards"),
    ({"ray": RayConfig(learners_per_policy=2)}, r"--ray.learners-per-policy 1"),
    ({"ppo": PPOConfig(advantage="vtrace")}, r"GAE\(lambda\) targets .*use --ppo.advantage gae"),  # was accepted
])
def test_what_it_cannot_do_is_refused_naming_the_flag(change, message):
    from orchestration.builder import build_trainer

    with pytest.raises(ValueError, match=message):
        build_trainer(dataclasses.replace(_config(), **change))


def test_off_by_default_and_bad_settings_are_refused():
    from orchestration.builder import build_trainer

    trainer = build_trainer(dataclasses.replace(_config(), team_critic=TeamCriticConfig()))
    assert trainer.team_critic is None and "team_critic" not in trainer.state()
    with pytest.raises(ValueError, match=r"--team-critic.lr\) must be > 0"):
        TeamCriticConfig(enabled=True, lr=0.0)


def test_the_config_survives_a_checkpoint_and_older_checkpoints_have_none():
    import json

    from orchestration.run_state import config_to_dict, load_config

    config = _config(team_critic=TeamCriticConfig(enabled=True, hidden_sizes=(32, 16), lr=1e-3))
    assert load_config({"config": json.loads(json.dumps(config_to_dict(config)))}) == config
    old = {k: v for k, v in config_to_dict(config).items() if k != "team_critic"}
    assert load_config({"config": old}).team_critic == TeamCriticConfig()


@pytest.mark.parametrize("clip", [None, 0.1])
def test_the_value_loss_is_ppos_value_term(clip):
    from core.losses import ppo_loss, value_loss

    g = torch.Generator().manual_seed(0)
    value, old, target, log_prob = (torch.randn(32, 3, 1, generator=g) for _ in range(4))
    mask = torch.rand(32, 3, generator=g) > 0.3
    target[~mask] = float("nan")  # absent entries must not matter
    value.requires_grad_(True)
    cfg = PPOConfig(value_coef=1.0, value_clip_eps=clip)
    behaviour = {"advantage": torch.randn(32, 3, 1, generator=g), "log_prob": log_prob, "state_value": old,
                 "value_target": target}
    ppo = ppo_loss(behaviour, {"log_prob": log_prob, "state_value": value, "entropy": torch.zeros(32, 3, 1)}, cfg, mask)
    ours = value_loss(value, old, target, mask, clip)
    torch.testing.assert_close(ours["loss_value"], ppo["loss_value"])
    torch.testing.assert_close(ours["explained_variance"], ppo["explained_variance"])
    grad, = torch.autograd.grad(ours["loss_value"], value)
    assert bool(torch.isfinite(grad).all()) and bool((grad[~mask] == 0).all())
