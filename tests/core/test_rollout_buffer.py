"""Seed 001's MultiAgentRolloutBuffer API, as a facade over fragments."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.buffers import MultiAgentRolloutBuffer
from core.layout import DONE, NEXT, TERMINATED, TRUNCATED

OBS = 3


@st.composite
def episodes(draw, max_agents: int = 3, max_steps: int = 6):
    """(n_agents, [steps]) with integer rewards, random dones and optional values/extras."""
    n = draw(st.integers(1, max_agents), label="n_agents")
    t = draw(st.integers(1, max_steps), label="steps")
    rewards = draw(st.lists(st.lists(st.integers(-3, 3), min_size=n, max_size=n), min_size=t, max_size=t))
    dones = draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=t, max_size=t))
    return n, [
        dict(states=torch.full((n, OBS), float(10 * s)) + torch.arange(n).unsqueeze(1),
             actions=torch.arange(n) + s, log_probs=-torch.rand(n),
             rewards={i: float(r) for i, r in enumerate(rewards[s])},  # seed 001 passes dicts per agent
             next_states=torch.full((n, OBS), float(10 * s + 10)), dones=torch.tensor(dones[s]),
             state_values=torch.randn(n, 1), next_state_values=torch.randn(n, 1),
             extras={"prev_hidden_states": torch.full((n, 2), float(s))})
        for s in range(t)
    ]


@given(ep=episodes())
def test_end_episode_matches_seed_001_statistics(ep):
    n, steps = ep
    buf = MultiAgentRolloutBuffer(n)
    for step in steps:
        buf.add_transition(**step)
    episode = buf.end_episode()
    t = len(steps)
    per_agent = [sum(s["rewards"][i] for s in steps) for i in range(n)]
    assert episode["episode_length"] == [t] * n
    assert episode["episode_reward"] == per_agent
    assert episode["average_episode_length"] == t
    assert math.isclose(episode["average_episode_reward"], sum(per_agent) / n, abs_tol=1e-6)
    assert buf.episodes == [episode] and buf.n_episodes == 1 and buf.total_steps == n * t
    # nested per-agent, per-step views trace back to the inputs
    for agent in range(n):
        assert len(episode["states"][agent]) == t
        for s, step in enumerate(steps):
            assert torch.equal(episode["states"][agent][s], step["states"][agent])
            assert torch.equal(episode["next_states"][agent][s], step["next_states"][agent])
            assert episode["actions"][agent][s] == step["actions"][agent]
            assert episode["log_probs"][agent][s] == step["log_probs"][agent]
            assert episode["rewards"][agent][s] == step["rewards"][agent]
            assert episode["dones"][agent][s] == step["dones"][agent]
            assert torch.equal(episode["state_values"][agent][s], step["state_values"][agent])
            assert torch.equal(episode["extras"]["prev_hidden_states"][agent][s],
                               step["extras"]["prev_hidden_states"][agent])
    # the episode is a fragment: the cut is a truncation unless every agent had terminated
    fragment = episode["fragment"]
    all_done = bool(steps[-1]["dones"].all())
    assert fragment[NEXT, DONE][0, -1, 0] and fragment[NEXT, TERMINATED][0, -1, 0] == all_done
    assert fragment[NEXT, TRUNCATED][0, -1, 0] == (not all_done)
    assert not fragment[NEXT, DONE][0, :-1].any()  # the env episode ends only at end_episode()


@given(first=episodes(), second=episodes(), seed=st.integers(0, 2**32 - 1))
def test_averages_accumulate_over_episodes_and_reset_clears(first, second, seed):
    n, steps = first
    buf = MultiAgentRolloutBuffer(n)
    assert math.isnan(buf.average_episode_length)
    lengths, rewards = [], []
    for ep_steps in (steps, steps[: max(1, len(steps) // 2)]):
        for step in ep_steps:
            buf.add_transition(**step)
        buf.end_episode()
        lengths.append(len(ep_steps))
        rewards.append(sum(sum(s["rewards"].values()) for s in ep_steps) / n)
    assert buf.average_episode_length == sum(lengths) / 2
    assert math.isclose(buf.average_episode_reward, sum(rewards) / 2, abs_tol=1e-6)
    mbs = buf.get_minibatches(2, torch.Generator().manual_seed(seed))
    assert sum(mb.batch_size[0] for mb in mbs) == sum(lengths)
    assert all(tuple(mb["agents"].batch_size) == (mb.batch_size[0], n) for mb in mbs)
    # reset(n_agents) starts over, possibly with another agent count
    n2, steps2 = second
    buf.reset(n2)
    assert buf.episodes == [] and buf.n_episodes == 0 and buf.total_steps == 0
    for step in steps2:
        buf.add_transition(**step)
    assert len(buf.current_episode["states"]) == n2 and len(buf.current_episode["states"][0]) == len(steps2)
    assert buf.end_episode()["episode_length"] == [len(steps2)] * n2


def test_reset_current_episode_discards_the_episode_in_progress():
    buf = MultiAgentRolloutBuffer(2)
    step = dict(states=torch.zeros(2, OBS), actions=torch.zeros(2), log_probs=torch.zeros(2),
                rewards=torch.ones(2), next_states=torch.ones(2, OBS), dones=torch.zeros(2, dtype=torch.bool))
    buf.add_transition(**step)
    buf.add_transition(**{**step, "extras": None})
    assert buf.current_episode["episode_reward"] == [2.0, 2.0]
    buf.reset_current_episode()
    assert buf.current_episode["states"] == [] and buf.extras == {}
    buf.add_transition(**step)
    episode = buf.end_episode()
    assert episode["episode_length"] == [1, 1] and episode["state_values"] == []  # values absent: not stored
    with pytest.raises(KeyError, match="state_value"):  # a step's keys must match the episode's first step
        buf.add_transition(**step, state_values=torch.zeros(2), next_state_values=torch.zeros(2))
    with pytest.raises(ValueError, match="3 agents"):
        MultiAgentRolloutBuffer(3).add_transition(**step)
    with pytest.raises(RuntimeError, match="reset"):
        MultiAgentRolloutBuffer().add_transition(**step)
