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
    buf.add_transition(**step, state_values=torch.zeros(2), next_state_values=torch.zeros(2))  # a new episode
    assert len(buf.current_episode["state_values"][0]) == 1  # may store keys the last one did not
    with pytest.raises(ValueError, match="3 agents"):
        MultiAgentRolloutBuffer(3).add_transition(**step)
    with pytest.raises(RuntimeError, match="reset"):
        MultiAgentRolloutBuffer().add_transition(**step)


@given(ep=episodes(), data=st.data())
def test_optional_keys_may_come_and_go_between_steps(ep, data):
    """A step may omit state values / an extra that other steps of the episode give, or give it first: every
    step stays aligned, omitted entries are NaN and ``present`` says which steps had them."""
    n, steps = ep
    t = len(steps)
    has_values = data.draw(st.lists(st.booleans(), min_size=t, max_size=t), label="has_values")
    has_extra = data.draw(st.lists(st.booleans(), min_size=t, max_size=t), label="has_extra")
    buf = MultiAgentRolloutBuffer(n)
    for step, v, x in zip(steps, has_values, has_extra):
        buf.add_transition(**{**step, "state_values": step["state_values"] if v else None,
                              "next_state_values": step["next_state_values"] if v else None,
                              "extras": step["extras"] if x else None})
    current = buf.current_episode
    episode = buf.end_episode()
    assert episode["episode_length"] == [t] * n and buf.total_steps == n * t
    for view in (current, episode):
        for name, key, given_at in (("state_values", None, has_values), ("extras", "prev_hidden_states", has_extra)):
            stored = view[name] if key is None else view[name].get(key, [])
            present = view["present"][name] if key is None else view["present"][name].get(key, [])
            if not any(given_at):  # never given: not stored, as before
                assert stored == [] and present == []
                continue
            for agent in range(n):
                assert present[agent].tolist() == given_at
                for s, step in enumerate(steps):
                    want = step[name] if key is None else step[name][key]
                    got = stored[agent][s]
                    assert torch.equal(got, want[agent]) if given_at[s] else got.isnan().all()
    # the fragment stores the masks; next-step values follow the same steps
    fragment = episode["fragment"]
    if any(has_values):
        assert fragment["agents", "present", "state_value"][0, :, 0].tolist() == has_values
        assert fragment["next", "agents", "state_value"][0, :, 0].isnan().all(-1).tolist() == [not v for v in has_values]
    assert buf.transitions().batch_size[0] == t


def test_optional_keys_differ_between_episodes_and_bad_shapes_are_named():
    buf = MultiAgentRolloutBuffer(2)
    step = dict(states=torch.zeros(2, OBS), actions=torch.zeros(2), log_probs=torch.zeros(2),
                rewards=torch.ones(2), next_states=torch.ones(2, OBS), dones=torch.zeros(2, dtype=torch.bool))
    ids = torch.tensor([3, 4])
    buf.add_transition(**step, extras={"ids": ids})
    buf.add_transition(**step)  # omitted integer extra: zero, marked absent
    first = buf.end_episode()
    assert first["extras"]["ids"][1].tolist() == [4, 0] and first["present"]["extras"]["ids"][1].tolist() == [True, False]
    buf.add_transition(**step, state_values=torch.ones(2), next_state_values=torch.ones(2))
    second = buf.end_episode()
    assert "ids" not in second["extras"] and second["present"]["state_values"][0].tolist() == [True]
    # episodes storing different optional keys still concatenate: the missing ones are filled, absent
    batch = buf.transitions()
    assert batch["agents", "present", "extras", "ids"].tolist() == [[True, True], [False, False], [False, False]]
    assert batch["agents", "present", "state_value"].tolist() == [[False, False], [False, False], [True, True]]
    assert batch["agents", "state_value"][:2].isnan().all() and (batch["agents", "state_value"][2] == 1).all()
    assert "state_value" not in first["fragment"]["agents"].keys()  # stored episodes are left as they were
    assert {tuple(mb["agents"].batch_size) for mb in buf.get_minibatches(2, torch.Generator().manual_seed(0))} \
        <= {(1, 2), (2, 2)}
    # a later step that gives a key with another per-agent shape is refused, naming the key; nothing is added
    buf.add_transition(**step, extras={"h": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match=r"extras\['h'\].*\(3,\).*\(4,\)"):
        buf.add_transition(**step, extras={"h": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"extras\['h'\].*2 agents"):
        buf.add_transition(**step, extras={"h": torch.zeros(3, 4)})
    assert len(buf.current_episode["states"][0]) == 1
