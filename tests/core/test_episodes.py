"""Episode statistics against a plain-Python recount, across fragment boundaries; per-agent trajectories."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.buffers import (
    FragmentBuilder,
    advance_carry,
    agent_trajectory,
    completed_episodes,
    episode_stats,
    summarize_episodes,
)
from core.layout import ENV_ID, EPISODE_ID, MASK, NEXT, OBSERVATION, REWARD
from tests.strategies import GROUP, episodes_by_hand, rollouts, step_streams
from tests.core.test_fragments import run_stream


def as_dict(records) -> dict[int, dict]:
    return {
        int(r[EPISODE_ID]): {"env": int(r[ENV_ID]), "length": int(r["length"]),
                             "agent_return": [int(x) for x in r["agent_return"].squeeze(-1).tolist()],
                             "agent_length": r["agent_length"].tolist()}
        for r in records
    }


@given(stream=step_streams())
def test_tracked_episode_records_equal_a_recount_of_the_stream(stream):
    builder, _ = run_stream(stream)
    records = builder.pop_completed_episodes()[GROUP]
    expected = episodes_by_hand(stream)
    assert as_dict(records) == expected
    assert torch.equal(records["team_return"], records["agent_return"].sum(1))
    assert builder.pop_completed_episodes() == {}  # popped once


@given(stream=step_streams())
def test_pure_functions_with_carry_equal_the_unbroken_stream(stream):
    _, fragments = run_stream(stream)
    whole = completed_episodes(torch.cat(fragments, dim=1), GROUP)
    carry, parts = None, []
    for frag in fragments:
        parts.append(completed_episodes(frag, GROUP, carry))
        carry = advance_carry(frag, carry)
    pieces = torch.cat(parts, 0)
    assert as_dict(pieces) == as_dict(whole) == episodes_by_hand(stream)
    # the carry after the stream holds each env's open episode, zero where the stream ended on a done
    for env in range(stream.num_envs):
        open_len = 0
        for d in stream.done[env]:
            open_len = 0 if d else open_len + 1
        assert int(carry["length"][env]) == open_len


@given(stream=step_streams())
def test_summary_averages_match_the_records(stream):
    _, fragments = run_stream(stream)
    stats = episode_stats(torch.cat(fragments, dim=1), GROUP)
    expected = list(episodes_by_hand(stream).values())
    assert int(stats["num_episodes"]) == len(expected)
    if not expected:
        assert math.isnan(float(stats["mean_length"])) and math.isnan(float(stats["mean_return"]))
        return
    assert math.isclose(float(stats["mean_length"]), sum(ep["length"] for ep in expected) / len(expected))
    team = [sum(ep["agent_return"]) for ep in expected]
    assert math.isclose(float(stats["mean_team_return"]), sum(team) / len(team), abs_tol=1e-5)
    all_returns = [r for ep in expected for r in ep["agent_return"]]
    assert math.isclose(float(stats["mean_return"]), sum(all_returns) / len(all_returns), abs_tol=1e-5)
    per_agent = [sum(ep["agent_return"][i] for ep in expected) / len(expected) for i in range(stream.num_agents)]
    torch.testing.assert_close(stats["mean_agent_return"].squeeze(-1), torch.tensor(per_agent))


def test_long_episode_sums_do_not_lose_precision():
    # segment sums, not differences of one running cumsum: a small return after a huge one stays exact
    e, t = 1, 4
    reward = torch.tensor([1e8, 1e8, 1.0, 2.0]).reshape(1, t, 1, 1)
    done = torch.tensor([False, True, False, True]).reshape(1, t, 1)
    rollout = TensorDict({NEXT: TensorDict({GROUP: TensorDict({REWARD: reward}, [e, t, 1]), "done": done}, [e, t])},
                         [e, t])
    records = completed_episodes(rollout, GROUP)
    assert records["agent_return"].flatten().tolist() == [2e8, 3.0]
    assert math.isnan(float(summarize_episodes(records[:0])["mean_length"]))


@given(rollout=rollouts(), data=st.data())
def test_agent_trajectory_traces_one_agent_and_honours_its_mask(rollout, data):
    e, t, a = rollout[GROUP].batch_size
    env = data.draw(st.integers(0, e - 1), label="env")
    agent = data.draw(st.integers(0, a - 1), label="agent")
    traj = agent_trajectory(rollout, GROUP, env, agent)
    present = rollout[GROUP, MASK][env, :, agent]
    assert traj.batch_size[0] == int(present.sum())
    assert torch.equal(traj["time"], present.nonzero().squeeze(-1))
    # uid encodes (env, step, agent): every row really is this agent at the recorded step
    uid = traj["uid"].squeeze(-1)
    assert torch.equal(uid, (env * t + traj["time"]) * a + agent)
    assert torch.equal(traj[NEXT, REWARD], traj[OBSERVATION][:, :1])
    assert torch.all(traj[EPISODE_ID] == env)
    full = agent_trajectory(rollout, GROUP, env, agent, present_only=False)
    assert full.batch_size[0] == t and torch.equal(full[MASK], present)


def test_builder_without_episode_tracking_keeps_ids_only():
    builder = FragmentBuilder(1, track_episodes=False)
    for d in (True, False):
        builder.add_step_({GROUP: {OBSERVATION: torch.zeros(1, 2)},
                           NEXT: {GROUP: {REWARD: torch.ones(1, 2, 1)}, "done": torch.tensor([[d]])}})
    frag = builder.build(0)
    assert frag[EPISODE_ID].tolist() == [[0, 1]] and builder.pop_completed_episodes() == {}
