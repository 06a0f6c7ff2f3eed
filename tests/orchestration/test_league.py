"""A league trainer drives a sub-trainer: frozen opponents from a growing pool, drawn by PFSP."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from core.losses import PPOConfig
from core.ratings import score_from_return
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.league import LeagueTrainer
from orchestration.builder import build_trainer


@pytest.mark.slow
def test_league_grows_a_pool_and_actors_play_the_drawn_opponent():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=6, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=8, fragment_length=32), ppo=PPOConfig(minibatch_size=128))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent", snapshot_every=2)
    draws = []
    for _ in range(6):
        metrics = league.train()
        draws.append(metrics["league_opponent"])
        actor_opponent = TensorDict.from_module(league.trainer.fleet.actors[0].policies["opponent"])
        assert (actor_opponent == league.current.weights).all()  # the actors played the drawn member
    assert len(league.pool) == 4 and metrics["league_size"] == 4  # initial + snapshots at 2, 4, 6
    assert sum(m.games for m in league.pool) > 0
    # Elo (core.ratings): reported, and moving towards whoever wins
    assert metrics["league_elo"] == league.rating and metrics["league_opponent_elo"] == league.current.rating
    initial = league.pool[0]
    if initial.games:  # the learner beat the random-initialised opponent more often than not: it gained on it
        assert (league.rating > initial.rating) == (initial.win_rate > 0.5) or initial.win_rate == 0.5
    learner_now = TensorDict.from_module(league.trainer.learners["player"].policy)
    assert not (learner_now == league.pool[1].weights).all()  # snapshots are copies, not views


def test_an_iterations_games_move_the_ratings_as_one_match_scored_by_their_mean():
    """As the role league rates (per-game updates summed over ~30 games swung the rating by ~100 a step)."""
    from core.ratings import INITIAL, MATCH_K

    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=2, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=8, fragment_length=32), ppo=PPOConfig(minibatch_size=128))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent", snapshot_every=10)
    metrics = league.train()
    score = score_from_return(torch.tensor(league.trainer.last_episodes["return/player"], dtype=torch.float64))
    assert metrics["league_games"] > 1
    gain = MATCH_K * (float(score.mean()) - 0.5)  # both at INITIAL: the expected score is 0.5
    assert metrics["league_elo"] == pytest.approx(INITIAL + gain)
    assert league.current.rating == pytest.approx(INITIAL - gain)
    league.trainer.close()


def test_a_league_is_seeded_with_in_memory_members_that_it_draws_and_plays():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=2, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=4, fragment_length=32), ppo=PPOConfig(minibatch_size=64))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent", snapshot_every=100,
                           pfsp_power=0.0)
    source = league.trainer.learners["player"].weights()[1]
    g = torch.Generator().manual_seed(0)
    seeded = [league.add_member(source.apply(lambda t: t + 0.1 * torch.randn(t.shape, generator=g)))
              for _ in range(3)]
    assert len(league.pool) == 4 and [m.name for m in seeded] == ["member/1", "member/2", "member/3"]
    assert league.add_member(source, name="mine").name == "mine"
    before = seeded[0].weights.clone()
    source.apply_(lambda t: t.add_(1.0))  # the member holds a copy
    assert (seeded[0].weights == before).all()
    with pytest.raises(ValueError, match="do not fit"):
        league.add_member(source.exclude(*list(source.keys())[:1]))
    league.pool[:] = seeded[1:2]  # only a seeded member left: the league must draw and play it
    metrics = league.train()
    assert league.current is seeded[1] and seeded[1].games > 0
    actor_opponent = TensorDict.from_module(league.trainer.fleet.actors[0].policies["opponent"])
    assert (actor_opponent == seeded[1].weights).all()
    returns = torch.tensor(league.trainer.last_episodes["return/player"], dtype=torch.float64)
    assert metrics["league_win_rate"] == float(score_from_return(returns).mean())  # this iteration's games
    assert metrics["league_opponent_win_rate"] == seeded[1].win_rate and metrics["league_games"] == len(returns)
    league.pool.append(seeded[0])
    tensors, state = league.state()
    again = LeagueTrainer(league.trainer, learner="player", opponent="opponent")
    again.load_state_(tensors, state)
    assert [(m.name, m.games, m.score, m.rating) for m in again.pool] == [
        (m.name, m.games, m.score, m.rating) for m in league.pool]
    assert all((a.weights == b.weights).all() for a, b in zip(again.pool, league.pool))
    assert again.current.name == "member/2" and again.rating == league.rating
    assert torch.equal(again.generator.get_state(), league.generator.get_state())
    with pytest.raises(ValueError, match="league member 'member/2'.*pool/0/"):
        again.load_state_({k: v[..., :1] if k.startswith("pool/0/") else v for k, v in tensors.items()}, state)
    league.trainer.close()


def test_league_refuses_a_learning_opponent():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", iterations=1,
                         rollout=RolloutConfig(num_envs=2, fragment_length=8))
    trainer = build_trainer(config)
    with pytest.raises(ValueError, match="fixed policy"):
        LeagueTrainer(trainer, learner="player", opponent="player")
    trainer.close()


def test_league_refuses_an_unknown_learner_and_no_snapshots_before_any_game():
    """Both were taken: a misspelt learner counted no games, then failed with a KeyError; snapshot_every=0
    failed after the first iteration (a modulo by zero)."""
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", iterations=1, fixed_policies=("opponent",),
                         policy_mapping=(("player_1", "opponent"),),
                         rollout=RolloutConfig(num_envs=2, fragment_length=8))
    trainer = build_trainer(config)
    try:
        with pytest.raises(ValueError, match=r"learner 'playr' is no learning policy of the trainer; they are "
                                             r"\['player'\] \(did you mean 'player'\?\)"):
            LeagueTrainer(trainer, learner="playr", opponent="opponent")
        with pytest.raises(ValueError, match="snapshot_every must be an int >= 1"):
            LeagueTrainer(trainer, learner="player", opponent="opponent", snapshot_every=0)
    finally:
        trainer.close()


def test_snapshots_saved_by_a_league_play_the_same_actions_in_a_new_process(tmp_path):
    import subprocess
    import sys

    from core.specs import rand
    from orchestration.snapshots import load_snapshot

    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=2, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=4, fragment_length=16), ppo=PPOConfig(minibatch_size=64))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent", snapshot_every=1)
    league.train()
    paths = league.save_pool(tmp_path / "pool")
    assert len(paths) == 2  # the initial member and one snapshot
    snapshot = load_snapshot(paths[-1])
    assert (snapshot.weights() == league.pool[-1].weights).all()
    obs = rand(snapshot.tree, (5,), torch.Generator().manual_seed(1)).get("player")
    inputs = {"observation": obs["observation"], "action_mask": obs["action_mask"]}
    torch.save(inputs, tmp_path / "obs.pt")  # test data (this process wrote it)
    here = snapshot.policy.act_step(inputs, None, None, True, with_value=False)["action"]
    script = ("import sys, torch; from orchestration.snapshots import load_snapshot; "
              "s = load_snapshot(sys.argv[1]); inputs = torch.load(sys.argv[2]); "
              "print(s.policy.act_step(inputs, None, None, True, with_value=False)['action'].tolist())")
    there = subprocess.run([sys.executable, "-c", script, str(paths[-1]), str(tmp_path / "obs.pt")],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert there == str(here.tolist())
    first = league.pool[0]
    member = league.add_snapshot(paths[0])  # its name is taken: a second member of one name would mix their stats
    assert len(league.pool) == 3 and (member.weights == first.weights).all() and member.name == f"{first.name}@2"
    assert first.rating != 1000.0 and member.rating == first.rating  # the rating survives; its games start again
    assert member.games == 0 and league.add_snapshot(paths[0], name="x").name == "x"
    assert league.add_member(first.weights, name="x").name == "x@2"  # in memory: the same rule
    league.trainer.close()


def test_a_snapshot_that_is_not_one_is_refused_by_name(tmp_path):
    import json

    from core.policies import PolicyConfig, make_policies
    from orchestration.checkpoint import CheckpointError
    from orchestration.envs import make_env
    from orchestration.snapshots import load_snapshot, save_snapshot

    tree = make_env("builtin:cartpole", 1).tree
    policy = make_policies(tree, PolicyConfig())["agent"]
    path = save_snapshot(tmp_path / "s", policy, tree, group="agent", policy_id="agent", version=3, config=PolicyConfig())
    assert load_snapshot(path).version == 3
    meta = json.loads((path / "snapshot.json").read_text())
    (path / "snapshot.json").write_text(json.dumps({**meta, "policy_config": {"hidden_sizes": [8]}}))
    with pytest.raises(CheckpointError, match="do not fit the declared policy"):
        load_snapshot(path)
    (path / "snapshot.json").write_text(json.dumps({**meta, "format": "pickle"}))
    with pytest.raises(CheckpointError, match="format must be"):
        load_snapshot(path)
    for rating in ("Infinity", "1" + "0" * 400, '"x"', "[1.0]"):
        (path / "snapshot.json").write_text(json.dumps(meta)[:-1] + ', "rating": ' + rating + "}")
        with pytest.raises(CheckpointError, match="'rating' must be a finite number"):
            load_snapshot(path)
    with pytest.raises(FileExistsError):
        save_snapshot(path, policy, tree, group="agent", policy_id="agent", version=3, config=PolicyConfig())


def test_a_league_draws_the_latest_member_or_uniformly_when_asked():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=3, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=4, fragment_length=16), ppo=PPOConfig(minibatch_size=64))
    trainer = build_trainer(config)
    latest = LeagueTrainer(trainer, learner="player", opponent="opponent", snapshot_every=1, sampling="latest")
    for _ in range(3):
        before = latest.pool[-1]
        latest.train()
        assert latest.current is before  # the newest member when the iteration started
    uniform = LeagueTrainer(trainer, learner="player", opponent="opponent", sampling="uniform", seed=3)
    for _ in range(3):
        uniform.add_member(uniform.pool[0].weights)
    uniform.pool[1].games, uniform.pool[1].score = 100, 100.0  # always beaten: PFSP would almost never draw it
    drawn = [uniform.pool.index(uniform._draw()) for _ in range(400)]
    assert all(60 < drawn.count(k) < 140 for k in range(4))
    with pytest.raises(ValueError, match="'pfsp', 'uniform', 'latest'"):
        LeagueTrainer(trainer, learner="player", opponent="opponent", sampling="newest")
    trainer.close()


def test_set_weights_refuses_weights_that_do_not_fit_and_names_an_unknown_policy():
    """An empty TensorDict was accepted (a new version, nothing loaded), NaN weights too; wrong shapes gave a
    tensordict size error without a key; an unknown id a bare KeyError; ``evaluate(-1)`` returned a mean of 0."""
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", iterations=1, fixed_policies=("opponent",),
                         policy_mapping=(("player_1", "opponent"),), eval_every=1,
                         rollout=RolloutConfig(num_envs=2, fragment_length=8))
    trainer = build_trainer(config)
    try:
        _, good = trainer.learners["opponent"].weights()
        with pytest.raises(ValueError, match=r"the weights do not fit the policy: missing \["):
            trainer.set_weights("opponent", TensorDict())
        key, value = next(iter(good.items(include_nested=True, leaves_only=True)))
        with pytest.raises(ValueError, match=r"the weights do not fit the policy: .* is torch.float32 \[1"):
            trainer.set_weights("opponent", good.clone().set(key, value.new_zeros(1, *value.shape)))
        with pytest.raises(ValueError, match="the weights hold a NaN or infinite value at"):
            trainer.set_weights("opponent", good.clone().set(key, torch.full_like(value, float("nan"))))
        with pytest.raises(ValueError, match=r"no policy 'oponent' in this run \(did you mean 'opponent'\?\)"):
            trainer.set_weights("oponent", good)
        with pytest.raises(ValueError, match=r"no learning policy 'playr' in this run \(did you mean 'player'\?\)"):
            trainer.reset_learner("playr", {})
        assert trainer.set_weights("opponent", good.clone()) == 1  # weights that fit: the next version
        with pytest.raises(ValueError, match="Trainer.evaluate: episodes must be >= 1, got -1"):
            trainer.evaluate(-1)
    finally:
        trainer.close()
