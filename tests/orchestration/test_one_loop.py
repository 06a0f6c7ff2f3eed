"""One training loop for every backend: asynchronous PPO in one process, per-group fixed policies, the
one builder, public state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig

ASYNC = TrainConfig(env="builtin:cartpole", seed=3, iterations=8, mode="async", max_staleness=1,
                    rollout=RolloutConfig(num_envs=4, fragment_length=16, num_workers=2), train_batch_size=64)


def _identity(m: dict) -> bool:
    return (m["fragments_accepted"] + m["fragments_stale"] + m["fragments_lost"] + m["fragments_in_flight"]
            == m["fragments_produced"])


def _run(config: TrainConfig, iterations: int) -> tuple[list[dict], TensorDict]:
    trainer = build_trainer(config)
    metrics = [trainer.train() for _ in range(iterations)]
    weights = TensorDict.from_module(trainer.learners["agent"].policy).clone()
    trainer.close()
    return metrics, weights


def test_async_mode_in_one_process_is_deterministic_and_trains_on_lagging_data():
    first, weights_a = _run(ASYNC, 6)
    second, weights_b = _run(ASYNC, 6)
    assert (weights_a == weights_b).all()  # a deterministic serial interleaving
    assert [m["policy_version"] for m in first] == list(range(1, 7))  # one training step per iteration
    assert [m["env_steps_trained"] for m in first] == [64 * (k + 1) for k in range(6)]  # one batch each
    assert [m["fragments_produced"] for m in first] == [m["fragments_produced"] for m in second]
    # A batch is one fragment of two produced per round: the second one reaches the learner one version late.
    assert max(m["trained_max_lag"] for m in first) == 1
    assert all(_identity(m) for m in first) and first[-1]["fragments_stale"] == 0
    sync, _ = _run(dataclasses.replace(ASYNC, mode="sync"), 2)
    assert sync[-1]["trained_max_lag"] == 0  # synchronous mode never trains on old data


def test_async_mode_drops_what_lags_beyond_max_staleness_and_never_trains_on_it():
    metrics, _ = _run(dataclasses.replace(ASYNC, max_staleness=0), 6)
    last = metrics[-1]
    assert last["fragments_stale"] >= 1 and last["trained_max_lag"] == 0
    assert _identity(last) and last["fragments_in_flight"] == last["fragments_produced"] - (
        last["fragments_accepted"] + last["fragments_stale"])


def test_async_reuse_limit_tops_up_batches_with_trained_data():
    config = dataclasses.replace(ASYNC, reuse_limit=2, max_staleness=4, train_batch_size=192)  # 3 fragments
    trainer = build_trainer(config)
    for _ in range(5):
        trainer.train()
    trained = trainer.learners["agent"].inbox.trained
    assert max(trained.values()) == 2 and set(trained.values()) <= {1, 2}
    trainer.close()


def test_running_statistics_count_a_fragment_reused_in_later_batches_once():
    from core.policies import PolicyConfig
    from orchestration.curiosity import CuriosityConfig

    config = dataclasses.replace(ASYNC, reuse_limit=3, max_staleness=4, train_batch_size=192,
                                 policy=PolicyConfig(normalize_observations=True), curiosity=CuriosityConfig(coef=0.1))
    trainer = build_trainer(config)
    for _ in range(5):
        trainer.train()
    learner = trainer.learners["agent"]
    trained = learner.inbox.trained  # fragment id -> times trained on
    assert max(trained.values()) > 1  # reused ...
    rows = 4 * 16 * len(trained)      # ... yet each fragment's rows counted once
    assert int(learner.policy.actor_encoder.obs_count0) == rows
    assert int(learner.curiosity.stats["obs_count"]) == rows
    trainer.close()


def test_a_random_policy_for_two_groups_with_different_spaces_gets_one_module_per_group():
    config = TrainConfig(env="mpe2:simple_speaker_listener_v4", iterations=1,
                         policy_mapping=(("speaker_0", "random"), ("listener_0", "random")),
                         rollout=RolloutConfig(num_envs=2, fragment_length=8))
    trainer = build_trainer(config)
    assert sorted(trainer.learners) == ["random@listener", "random@speaker"]
    metrics = trainer.train()  # nothing learns: the run collects and reports
    assert metrics["env_steps"] == 16 and metrics["fragments_produced"] == 1
    trainer.close()


def test_a_learned_policy_over_groups_with_different_spaces_is_refused_naming_them():
    config = TrainConfig(env="mpe2:simple_speaker_listener_v4", iterations=1,
                         policy_mapping=(("speaker_0", "shared"), ("listener_0", "shared")),
                         rollout=RolloutConfig(num_envs=2, fragment_length=8))
    with pytest.raises(ValueError, match=r"'shared' acts for groups \['speaker', 'listener'\]"):
        build_trainer(config)


def test_a_misspelled_agent_in_the_mapping_names_the_nearest_agent():
    config = TrainConfig(env="builtin:spread", policy_mapping=(("agent_1", "other"),))
    with pytest.raises(KeyError, match="did you mean 'agents_1'"):
        build_trainer(config)


def test_actor_state_round_trips_into_a_fresh_actor_and_continues_identically():
    config = dataclasses.replace(ASYNC, mode="sync")
    a, b = build_trainer(config), build_trainer(dataclasses.replace(config, seed=99))
    actor_a, actor_b = a.fleet.actors[0], b.fleet.actors[0]
    actor_a.collect()
    for pid, learner in a.learners.items():
        actor_b.set_weights(pid, *learner.published(), force=True)
    actor_b.load_state_(actor_a.state())
    fa, fb = actor_a.collect(), actor_b.collect()
    assert (fa == fb).all() and actor_a.fragment_meta(fa) == actor_b.fragment_meta(fb)


def test_set_weights_reaches_every_actor_and_refuses_a_learning_policy():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", iterations=1, fixed_policies=("opponent",),
                         policy_mapping=(("player_1", "opponent"),),
                         rollout=RolloutConfig(num_envs=2, fragment_length=8, num_workers=2))
    trainer = build_trainer(config)
    new = trainer.learners["player"].weights()[1].apply(torch.ones_like)
    version = trainer.set_weights("opponent", new)
    assert version == 1 and all((w == new).all() for w in trainer.fleet.actor_weights("opponent"))
    with pytest.raises(ValueError, match="learns"):
        trainer.set_weights("player", new)
    trainer.close()


def test_sync_mode_trains_each_fragment_once_and_async_resume_says_it_is_not_exact():
    sync = build_trainer(dataclasses.replace(ASYNC, mode="sync", reuse_limit=3))
    for _ in range(3):
        sync.train()
    assert not sync.learners["agent"].inbox.pool  # nothing kept for reuse: no pool growing run-long
    assert set(sync.learners["agent"].inbox.trained.values()) == {1} and sync.resume_exact
    sync.close()
    streaming = build_trainer(ASYNC)
    streaming.train()
    assert not streaming.resume_exact  # fragments wait in the pool between iterations; a checkpoint drops them
    streaming.close()


def test_a_vmas_scenario_trains_from_an_env_id():
    pytest.importorskip("vmas")
    config = TrainConfig(env="vmas:navigation", iterations=2, seed=0,
                         env_kwargs=(("n_agents", "2"), ("continuous_actions", "False"), ("max_steps", "20")),
                         rollout=RolloutConfig(num_envs=8, fragment_length=16))
    trainer = build_trainer(config)
    assert trainer.fleet.actors[0].env.num_envs == 8
    for _ in range(2):
        metrics = trainer.train()
    assert metrics["policy_version"] == 2 and metrics["env_steps"] == 2 * 8 * 16 and metrics["episodes"] > 0
    trainer.close()


def test_zero_sum_games_report_win_rates_and_competitive_groups_their_own_returns():
    from orchestration.statistics import structure_metrics

    four = build_trainer(TrainConfig(env="pettingzoo:classic.connect_four_v3", iterations=1, seed=0,
                                     rollout=RolloutConfig(num_envs=8, fragment_length=64)))
    metrics = four.train()
    assert metrics["episodes"] > 0 and metrics["episode_return_mean"] == 0.0  # zero-sum: the sum says nothing
    for seat in ("player_0", "player_1"):
        rates = [metrics[f"{kind}_rate/{seat}"] for kind in ("win", "draw", "loss")]
        assert sum(rates) == pytest.approx(1.0)
    assert metrics["win_rate/player_0"] == pytest.approx(metrics["loss_rate/player_1"])  # one winner per game
    four.close()
    adversary = build_trainer(TrainConfig(env="mpe2:simple_adversary_v3", iterations=1, seed=0,
                                          env_kwargs=(("max_cycles", "10"),),
                                          rollout=RolloutConfig(num_envs=4, fragment_length=20)))
    metrics = adversary.train()
    teams = {k for k in metrics if k.startswith("episode_return_mean/group/")}
    assert teams == {"episode_return_mean/group/adversary", "episode_return_mean/group/agent"}
    assert not any(k.startswith("win_rate/") for k in metrics)  # general-sum: no win rates
    adversary.close()
    spec = type("Spec", (), {"capacity": 2, "payoff": "zero_sum", "agent_names": ("a", "b")})()
    out = structure_metrics({"g": [[1.0, -1.0], [0.0, 0.0], [-1.0, 1.0], [1.0, -1.0]]}, {"g": spec})
    assert (out["win_rate/a"], out["draw_rate/a"], out["loss_rate/a"]) == (0.5, 0.25, 0.25)


def _evaluates_on_demand(config: TrainConfig) -> None:
    """Without ``eval_every``, ``evaluate`` builds its deterministic actor when first asked, acts with the
    learner's newest weights (the same return as a trainer that evaluates every iteration), and is closed
    with the trainer."""
    lazy = build_trainer(config)
    eager = build_trainer(dataclasses.replace(config, eval_every=1, eval_episodes=4))
    try:
        assert lazy.evaluator is None
        lazy.train()
        assert lazy.evaluate(4)["eval_return_mean"] == eager.train()["eval_return_mean"]
        assert lazy.evaluator is not None
        closed = []
        env_close = lazy.evaluator.env.close
        lazy.evaluator.env.close = lambda: (closed.append(True), env_close())
    finally:
        lazy.close(), eager.close()
    assert closed == [True]  # the evaluator's envs go with the trainer
    with pytest.raises(RuntimeError, match="closed"):
        lazy.evaluate(1)


def test_evaluate_on_demand_without_eval_every():
    _evaluates_on_demand(TrainConfig(env="builtin:cartpole", seed=1, iterations=2,
                                     rollout=RolloutConfig(num_envs=4, fragment_length=16)))


@pytest.mark.ray
def test_evaluate_on_demand_without_eval_every_on_ray(ray_session):
    from orchestration.config import RayConfig

    _evaluates_on_demand(TrainConfig(env="builtin:cartpole", seed=1, iterations=2, backend="ray",
                                     ray=RayConfig(learner_num_cpus=0, worker_num_cpus=0),
                                     rollout=RolloutConfig(num_envs=4, fragment_length=16)))


def test_training_past_the_budget_warns_that_the_annealed_learning_rate_is_zero():
    trainer = build_trainer(TrainConfig(env="builtin:cartpole", iterations=1,
                                        rollout=RolloutConfig(num_envs=4, fragment_length=16)))
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            trainer.train()  # within the budget: silent
        with pytest.warns(UserWarning, match=r"iteration 2 is past TrainConfig.iterations=1.*nothing learns"):
            trainer.train()
    finally:
        trainer.close()
