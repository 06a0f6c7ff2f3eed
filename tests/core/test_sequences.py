"""Training sequences (core.buffers.split_sequences) and truncated BPTT (GroupPolicy.evaluate_sequence).

The differential test replays the actor's loop step by step (act_step carrying the state, zeroed at episode
starts) and checks the sequence evaluation against it; the gradient tests check what BPTT of length 1 could not
do: the loss at step t reaches the inputs of step t - 1, unless an episode started in between.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.buffers import sequence_starts, split_sequences
from core.layout import ACTION, EPISODE_ID, LOG_PROB, MASK, NEXT, OBSERVATION, RECURRENT_STATE, SEQUENCE_START, \
    STATE_VALUE
from core.policies import GroupPolicy, PolicyConfig
from core.specs import AgentNode, Leaf, groups

E, T, A = 3, 7, 2


def _batch(e: int, t: int, starts: torch.Tensor, agents: int = 1) -> TensorDict:
    """``[e, t]``: step index as observation, episode ids that change where ``starts``."""
    index = torch.arange(e * t, dtype=torch.float32).reshape(e, t, 1, 1).expand(e, t, agents, 1)
    episode = starts.long().cumsum(1) + 100 * torch.arange(e)[:, None]
    return TensorDict({"g": TensorDict({OBSERVATION: index.clone()}, batch_size=[e, t, agents]),
                       EPISODE_ID: episode}, batch_size=[e, t])


@given(e=st.integers(1, 3), t=st.integers(1, 12), length=st.integers(1, 14), burn_in=st.integers(0, 5),
       data=st.data())
def test_every_step_is_trained_exactly_once_and_windows_hold_what_came_before(e, t, length, burn_in, data):
    starts = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=e,
                                             max_size=e)), dtype=torch.bool).reshape(e, t)
    batch = _batch(e, t, starts)
    seq = split_sequences(batch, length, burn_in, "g")
    window = burn_in + min(length, t)
    assert seq.batch_size == (e * -(-t // min(length, t)),) and seq["g"].batch_size[1:] == (window, 1)
    trained = seq["g", MASK][..., 0]
    ids = seq["g", OBSERVATION][..., 0, 0]
    assert sorted(ids[trained].long().tolist()) == list(range(e * t))  # each step once
    assert not trained[:, :burn_in].any()  # burn-in steps are never trained on
    # a window is consecutive steps of one row; the state is loaded at its first real step and at episode starts
    flat_starts = starts | (torch.arange(t) == 0)
    for s in range(seq.batch_size[0]):
        real = [int(i) for i in ids[s].tolist()]
        row, first = real[0] // t, None
        for j, i in enumerate(real):
            assert i // t == row
            if j and i != real[j - 1]:
                assert i == real[j - 1] + 1
                if first is None:
                    first = j - 1
            loaded = bool(seq[SEQUENCE_START][s, j])
            if j and i != real[j - 1]:
                assert loaded == bool(flat_starts[row, i % t])
        assert seq[SEQUENCE_START][s, 0]


def test_sequence_starts_mark_episode_changes():
    ids = torch.tensor([[4, 4, 5, 5, 5, 6], [1, 1, 1, 1, 1, 1]])
    assert sequence_starts(ids).tolist() == [[True, False, True, False, False, True], [True] + [False] * 5]


def _policy(cell: str, critic: bool, seed: int = 0) -> GroupPolicy:
    torch.manual_seed(seed)
    tree = AgentNode(observation=Leaf.box((3,)), action=Leaf.discrete(4))
    spec = next(iter(groups(tree).values()))
    config = PolicyConfig(recurrent=True, recurrent_cell=cell, recurrent_critic=critic, recurrent_size=6,
                          hidden_sizes=(8,))
    return GroupPolicy(spec, config)


def _rollout(policy: GroupPolicy, starts: torch.Tensor, seed: int = 0) -> TensorDict:
    """The actor's loop: ``[E, T]`` steps of random observations, the state carried and zeroed at episode starts."""
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(E, T, 1, 3, generator=gen)
    state, steps = None, []
    for t in range(T):
        out = policy.act_step({OBSERVATION: obs[:, t]}, generator=gen, recurrent_state=state,
                              episode_start=starts[:, t] if t else None)
        state = out[NEXT][RECURRENT_STATE]
        steps.append({OBSERVATION: obs[:, t], ACTION: out[ACTION], LOG_PROB: out[LOG_PROB],
                      STATE_VALUE: out[STATE_VALUE], RECURRENT_STATE: out[RECURRENT_STATE]})
    group = TensorDict({k: torch.stack([s[k] for s in steps], 1) for k in steps[0]}, batch_size=[E, T, 1])
    episode = starts.long().cumsum(1)
    return TensorDict({"agent": group, EPISODE_ID: episode}, batch_size=[E, T])


STARTS = torch.zeros(E, T, dtype=torch.bool)
STARTS[0, 3] = STARTS[2, 5] = True


@pytest.mark.parametrize("cell,critic", [("gru", False), ("lstm", True), ("gru", True)])
def test_sequence_evaluation_equals_the_actors_step_by_step_loop(cell, critic):
    policy = _policy(cell, critic)
    rollout = _rollout(policy, STARTS)
    for length, burn_in in ((T, 0), (3, 0), (3, 2)):
        seq = split_sequences(rollout, length, burn_in, "agent")
        out = policy.evaluate_sequence(seq["agent"], None, seq[SEQUENCE_START])
        trained = seq["agent", MASK]
        for key in (LOG_PROB, STATE_VALUE):
            torch.testing.assert_close(out[key][trained], seq["agent", key][trained], atol=1e-5, rtol=1e-5)


def test_recurrent_critic_values_carry_its_state_and_next_values_use_the_state_after_the_step():
    policy = _policy("lstm", True)
    rollout = _rollout(policy, STARTS)
    g = rollout["agent"]
    values, next_values = policy.sequence_values(g, None, g, None, sequence_starts(rollout[EPISODE_ID]))
    torch.testing.assert_close(values, g[STATE_VALUE], atol=1e-5, rtol=1e-5)
    # next observation = this one again, seen with the state after the step: differs from the value before it
    assert not torch.allclose(next_values, values)
    step = policy.act_step({OBSERVATION: g[OBSERVATION][:, 0]}, generator=torch.Generator().manual_seed(0),
                           recurrent_state=g[RECURRENT_STATE][:, 0])
    again = policy.act_step({OBSERVATION: g[OBSERVATION][:, 0]}, generator=torch.Generator().manual_seed(0),
                            recurrent_state=step[NEXT][RECURRENT_STATE])
    torch.testing.assert_close(next_values[:, 0], again[STATE_VALUE], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_the_loss_at_a_step_reaches_earlier_steps_through_the_state_unless_an_episode_starts(cell):
    policy = _policy(cell, True)
    rollout = _rollout(policy, STARTS)
    seq = split_sequences(rollout, T, 0, "agent")
    obs = seq["agent", OBSERVATION].clone().requires_grad_(True)
    group = seq["agent"].clone().set(OBSERVATION, obs)
    out = policy.evaluate_sequence(group, None, seq[SEQUENCE_START])
    (out[LOG_PROB][:, 5].sum() + out[STATE_VALUE][:, 5].sum()).backward()
    reach = obs.grad.abs().sum((-1, -2))  # [E, T]
    assert (reach[1, :5] > 0).all() and (reach[:, 6:] == 0).all()
    assert (reach[0, 3:5] > 0).all() and (reach[0, :3] == 0).all()  # env 0's episode started at step 3
    assert (reach[2, :5] == 0).all() and reach[2, 5] > 0  # env 2's started at step 5
    # the one-step evaluation from stored states sends nothing back (what sequences fix)
    obs1 = seq["agent", OBSERVATION].clone().requires_grad_(True)
    one = policy.evaluate_terms(seq["agent"].clone().set(OBSERVATION, obs1), None)
    one[LOG_PROB][:, 5].sum().backward()
    assert (obs1.grad.abs().sum((-1, -2))[:, :5] == 0).all()


def test_a_missing_or_wrong_size_state_is_named():
    policy = _policy("lstm", True)
    with pytest.raises(ValueError, match="recurrent_state must end with 24"):
        policy.split_state(torch.zeros(2, 1, 12))
    with pytest.raises(ValueError, match="recurrent_critic"):
        PolicyConfig(recurrent_critic=True)
