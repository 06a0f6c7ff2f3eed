"""GAE and V-trace in the ``[env, time, agent, 1]`` layout against textbook backward loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import ADVANTAGE, DONE, LOG_PROB, MASK, NEXT, REWARD, STATE_VALUE, TERMINATED, TRUNCATED, VALUE_TARGET
from core.losses import gae, vtrace, with_gae, with_vtrace

G = "agents"


@st.composite
def estimator_inputs(draw, max_envs: int = 3, max_steps: int = 7, max_agents: int = 3) -> dict:
    """Random ``[E, T, A, 1]`` inputs: done = terminated | truncated, optional agent mask with NaN padding."""
    e, t, a = (draw(st.integers(1, m), label=n) for m, n in ((max_envs, "E"), (max_steps, "T"), (max_agents, "A")))
    probabilities = st.sampled_from([0.0, 0.2, 0.5, 1.0])
    p_done, p_term, p_absent = (draw(probabilities, label=n) for n in ("done", "term", "absent"))
    with_mask = draw(st.booleans(), label="with_mask")
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    shape = (e, t, a, 1)
    done = torch.rand(shape, generator=g) < p_done
    terminated = done & (torch.rand(shape, generator=g) < p_term)
    x = dict(
        state_value=torch.randn(shape, generator=g), next_state_value=torch.randn(shape, generator=g),
        reward=torch.randn(shape, generator=g), done=done, terminated=terminated,
        target_log_prob=-torch.rand(shape, generator=g) * 2, behaviour_log_prob=-torch.rand(shape, generator=g) * 2,
        mask=(torch.rand(shape[:-1], generator=g) >= p_absent) if with_mask else None,
    )
    if with_mask:  # padding may hold anything: it must not reach present steps
        absent = ~x["mask"].unsqueeze(-1)
        for k in ("state_value", "next_state_value", "reward", "target_log_prob", "behaviour_log_prob"):
            x[k] = x[k].masked_fill(absent, math.nan)
    return x


def _present(x: dict, e: int, t: int, a: int) -> bool:
    return x["mask"] is None or bool(x["mask"][e, t, a])


def _cut(x: dict, e: int, t: int, a: int) -> bool:
    """Trajectory ends after step t: done, next step absent, or the fragment ends."""
    last = t + 1 == x["reward"].shape[1]
    return bool(x["done"][e, t, a, 0]) or last or not _present(x, e, t + 1, a)


def textbook_gae(x: dict, gamma: float, lmbda: float) -> tuple[torch.Tensor, torch.Tensor]:
    adv, target = torch.zeros_like(x["reward"]), torch.zeros_like(x["reward"])
    e_, t_, a_, _ = x["reward"].shape
    for e in range(e_):
        for a in range(a_):
            following = 0.0  # advantage of step t + 1 when it continues step t's trajectory
            for t in reversed(range(t_)):
                if not _present(x, e, t, a):
                    following = 0.0
                    continue
                v, v_next, r = (float(x[k][e, t, a, 0]) for k in ("state_value", "next_state_value", "reward"))
                bootstrap = 0.0 if x["terminated"][e, t, a, 0] else gamma * v_next
                delta = r + bootstrap - v
                a_t = delta + (0.0 if _cut(x, e, t, a) else gamma * lmbda * following)
                adv[e, t, a, 0], target[e, t, a, 0] = a_t, a_t + v
                following = a_t
    return adv, target


def textbook_vtrace(x: dict, gamma: float, rho_bar: float, c_bar: float) -> tuple[torch.Tensor, torch.Tensor]:
    """IMPALA eq. (1) as a backward recursion, plus the policy-gradient advantage of its section 4.2."""
    adv, vs = torch.zeros_like(x["reward"]), torch.zeros_like(x["reward"])
    e_, t_, a_, _ = x["reward"].shape
    for e in range(e_):
        for a in range(a_):
            vs_next = correction_next = 0.0  # v_{t+1} and v_{t+1} - V(x_{t+1}) of the same trajectory
            for t in reversed(range(t_)):
                if not _present(x, e, t, a):
                    continue
                v, v_next, r = (float(x[k][e, t, a, 0]) for k in ("state_value", "next_state_value", "reward"))
                is_ratio = math.exp(float(x["target_log_prob"][e, t, a, 0] - x["behaviour_log_prob"][e, t, a, 0]))
                rho, c = min(rho_bar, is_ratio), min(c_bar, is_ratio)
                not_term = 0.0 if x["terminated"][e, t, a, 0] else 1.0
                cut = _cut(x, e, t, a)
                delta = r + gamma * not_term * v_next - v
                # V(x_{t+1}) inside the trace is state_value[t + 1] (next_state_value[t] only bootstraps)
                vs_t = v + rho * delta + (0.0 if cut else gamma * c * correction_next)
                v_tp1 = v_next if cut else vs_next
                adv[e, t, a, 0], vs[e, t, a, 0] = rho * (r + gamma * not_term * v_tp1 - v), vs_t
                vs_next, correction_next = vs_t, vs_t - v
    return adv, vs


@given(x=estimator_inputs(), gamma=st.sampled_from([0.0, 0.9, 0.99, 1.0]), lmbda=st.sampled_from([0.0, 0.5, 0.95, 1.0]))
def test_gae_matches_textbook_loop(x, gamma, lmbda):
    args = [x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated", "mask")]
    advantage, value_target = gae(*args, gamma=gamma, lmbda=lmbda)
    ref_adv, ref_target = textbook_gae(x, gamma, lmbda)
    torch.testing.assert_close(advantage, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value_target, ref_target, atol=1e-5, rtol=1e-5)


@given(x=estimator_inputs(max_envs=9), chunk_entries=st.integers(1, 40), max_calls=st.sampled_from([2, 3, 10**6]),
       wide_next=st.booleans())
def test_gae_of_a_large_batch_is_estimated_in_chunks_of_envs_with_the_same_result(x, chunk_entries, max_calls,
                                                                                  wide_next):
    """Past ``GAE_CHUNK`` entries the batch goes a chunk of envs at a time, in at most ``GAE_CALLS`` calls
    (bounded temporaries): bit for bit, and in the same dtype, the whole-batch result."""
    import core.losses.advantages as advantages

    if wide_next:  # mixed float dtypes: the estimator promotes; chunks must give the same dtype
        x = dict(x, next_state_value=x["next_state_value"].double())
    args = [x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated", "mask")]
    whole = gae(*args, gamma=0.99, lmbda=0.95)
    calls: list[int] = []
    rows, chunk, most = advantages._gae_rows, advantages.GAE_CHUNK, advantages.GAE_CALLS

    def counted(estimator, gamma, lmbda, state_value, *rest):
        calls.append(state_value.shape[0])
        return rows(estimator, gamma, lmbda, state_value, *rest)

    advantages._gae_rows, advantages.GAE_CHUNK, advantages.GAE_CALLS = counted, chunk_entries, max_calls
    try:
        chunked = gae(*args, gamma=0.99, lmbda=0.95)
    finally:
        advantages._gae_rows, advantages.GAE_CHUNK, advantages.GAE_CALLS = rows, chunk, most
    envs, per_env = x["state_value"].shape[0], x["state_value"][0].numel()
    assert sum(calls) == envs and len(calls) <= max_calls
    if max_calls > envs:  # only GAE_CHUNK decides
        assert len(calls) == -(-envs // max(1, chunk_entries // per_env))
    for a, b in zip(whole, chunked):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_gae_of_no_envs_is_empty():
    zeros = torch.zeros(0, 5, 2, 1)
    flags = torch.zeros(0, 5, 2, 1, dtype=torch.bool)
    advantage, value_target = gae(zeros, zeros, zeros, flags, flags, gamma=0.99, lmbda=0.95)
    assert advantage.shape == value_target.shape == (0, 5, 2, 1)


@given(x=estimator_inputs(), gamma=st.sampled_from([0.0, 0.9, 1.0]), rho_bar=st.sampled_from([0.5, 1.0, 2.0]),
       c_bar=st.sampled_from([0.5, 1.0]))
def test_vtrace_matches_textbook_loop(x, gamma, rho_bar, c_bar):
    args = [x[k] for k in ("target_log_prob", "behaviour_log_prob", "state_value", "next_state_value", "reward",
                           "done", "terminated", "mask")]
    advantage, value_target = vtrace(*args, gamma=gamma, rho_thresh=rho_bar, c_thresh=c_bar)
    ref_adv, ref_vs = textbook_vtrace(x, gamma, rho_bar, c_bar)
    torch.testing.assert_close(advantage, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value_target, ref_vs, atol=1e-5, rtol=1e-5)


@given(x=estimator_inputs(), gamma=st.sampled_from([0.9, 1.0]))
def test_on_policy_vtrace_equals_gae_with_lambda_one(x, gamma):
    """With pi == mu and rho_bar = c_bar = 1, v_s is the lambda = 1 return (IMPALA, remark 1).

    The advantages agree only on consistent data: V(s_{t+1}) = next_state_value[t] = state_value[t + 1]
    inside a trajectory.
    """
    x = dict(x)
    nsv, sv = x["next_state_value"].clone(), x["state_value"]
    keep = x["done"][:, :-1].clone()
    if x["mask"] is not None:
        keep |= ~x["mask"][:, 1:].unsqueeze(-1)
    nsv[:, :-1] = torch.where(keep, nsv[:, :-1], sv[:, 1:])
    x["next_state_value"] = nsv
    common = [x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated", "mask")]
    adv_v, vs = vtrace(x["behaviour_log_prob"], x["behaviour_log_prob"], *common, gamma=gamma)
    adv_g, target_g = gae(*common, gamma=gamma, lmbda=1.0)
    torch.testing.assert_close(vs, target_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv_v, adv_g, atol=1e-5, rtol=1e-5)


def test_truncation_bootstraps_and_termination_does_not():
    one = torch.ones(1, 1, 1, 1)
    v, v_next, r, yes, no = 0.5 * one, 2.0 * one, one, one.bool(), ~one.bool()
    adv_trunc, _ = gae(v, v_next, r, yes, no, gamma=0.9, lmbda=0.95)
    adv_term, _ = gae(v, v_next, r, yes, yes, gamma=0.9, lmbda=0.95)
    assert adv_trunc.item() == pytest.approx(1.0 + 0.9 * 2.0 - 0.5)
    assert adv_term.item() == pytest.approx(1.0 - 0.5)


def test_absence_cuts_the_trajectory_both_ways():
    """Agent present at t = 0, 1, absent at 2, back at 3, 4: rewards after the gap never reach t <= 1."""
    shape = (1, 5, 1, 1)
    x = dict(state_value=torch.zeros(shape), next_state_value=torch.ones(shape), reward=torch.ones(shape),
             done=torch.zeros(shape, dtype=torch.bool), terminated=torch.zeros(shape, dtype=torch.bool),
             mask=torch.tensor([[[True], [True], [False], [True], [True]]]))
    args = [x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated", "mask")]
    adv, target = gae(*args, gamma=0.5, lmbda=1.0)
    x["reward"] = x["reward"].clone()
    x["reward"][0, 3:] = 100.0
    adv2, _ = gae(*[x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated", "mask")],
                  gamma=0.5, lmbda=1.0)
    assert adv[0, 2].item() == 0.0 and target[0, 2].item() == 0.0
    torch.testing.assert_close(adv2[0, :2], adv[0, :2])  # nothing leaks backwards across the gap
    assert adv[0, 1].item() == pytest.approx(1.0 + 0.5 * 1.0)  # step 1 is cut and bootstrapped (truncation)


def _rollout(x: dict, group_flags: bool = True) -> TensorDict:
    e, t, a, _ = x["reward"].shape
    group = TensorDict({STATE_VALUE: x["state_value"], LOG_PROB: x["behaviour_log_prob"]}, batch_size=[e, t, a])
    if x["mask"] is not None:
        group[MASK] = x["mask"]
    nxt = TensorDict({STATE_VALUE: x["next_state_value"], REWARD: x["reward"]}, batch_size=[e, t, a])
    if group_flags:
        nxt.update({DONE: x["done"], TERMINATED: x["terminated"], TRUNCATED: x["done"] & ~x["terminated"]})
    return TensorDict({G: group, NEXT: TensorDict({G: nxt}, batch_size=[e, t])}, batch_size=[e, t])


@given(x=estimator_inputs())
def test_with_gae_and_with_vtrace_write_the_tensor_results_into_a_copy(x):
    rollout = _rollout(x)
    before = set(rollout.keys(True, True))
    out = with_gae(rollout, G, 0.9, 0.8)
    args = [x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated", "mask")]
    adv, target = gae(*args, gamma=0.9, lmbda=0.8)
    assert torch.equal(out[G, ADVANTAGE], adv) and torch.equal(out[G, VALUE_TARGET], target)
    assert set(rollout.keys(True, True)) == before  # the caller's rollout is untouched
    out_v = with_vtrace(rollout, G, 0.9, 1.0, 1.0, target_log_prob=x["target_log_prob"])
    adv_v, vs = vtrace(x["target_log_prob"], *[x[k] for k in ("behaviour_log_prob", "state_value",
                       "next_state_value", "reward", "done", "terminated", "mask")], gamma=0.9)
    assert torch.equal(out_v[G, ADVANTAGE], adv_v) and torch.equal(out_v[G, VALUE_TARGET], vs)


@given(x=estimator_inputs())
def test_env_level_flags_are_expanded_over_agents(x):
    e, t, a, _ = x["reward"].shape
    env_done, env_term = x["done"][:, :, :1, 0], x["terminated"][:, :, :1, 0]  # [E, T, 1]
    x_group = dict(x, done=env_done.unsqueeze(-1).expand(e, t, a, 1),
                   terminated=env_term.unsqueeze(-1).expand(e, t, a, 1))
    rollout = _rollout(x_group, group_flags=False)
    rollout[NEXT, DONE], rollout[NEXT, TERMINATED] = env_done, env_term
    expected = with_gae(_rollout(x_group), G, 0.9, 0.8)
    out = with_gae(rollout, G, 0.9, 0.8)
    assert torch.equal(out[G, ADVANTAGE], expected[G, ADVANTAGE])


def test_shape_errors_name_the_key_and_both_shapes():
    shape = (2, 3, 2, 1)
    x = dict(state_value=torch.zeros(shape), next_state_value=torch.zeros(shape), reward=torch.zeros(shape),
             done=torch.zeros(shape, dtype=torch.bool), terminated=torch.zeros(shape, dtype=torch.bool),
             behaviour_log_prob=torch.zeros(shape), mask=None)
    rollout = _rollout(x)
    rollout[NEXT, G, REWARD] = torch.zeros(2, 3, 2)  # trailing 1 missing: must not broadcast
    with pytest.raises(ValueError, match=r"'next', 'agents', 'reward'.*\[2, 3, 2, 1\].*\[2, 3, 2\]"):
        with_gae(rollout, G, 0.9, 0.9)
    rollout = _rollout(x)
    rollout[NEXT, G, DONE] = torch.zeros(shape)  # float flag
    with pytest.raises(ValueError, match="'done'.*bool"):
        with_gae(rollout, G, 0.9, 0.9)
    rollout = _rollout(x)
    del rollout[NEXT, G, TERMINATED]
    with pytest.raises(KeyError, match="terminated"):
        with_gae(rollout, G, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"target_log_prob.*\[2, 3, 2, 1\]"):
        with_vtrace(_rollout(x), G, 0.9, target_log_prob=torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="mask"):
        gae(*[x[k] for k in ("state_value", "next_state_value", "reward", "done", "terminated")],
            torch.ones(2, 3, 2, 1, dtype=torch.bool), gamma=0.9, lmbda=0.9)


def test_gae_refuses_a_discount_or_lambda_outside_zero_to_one():
    """gamma 1.5 made returns grow without bound, in silence (PPOConfig refused it; a direct call did not)."""
    import pytest
    import torch

    from core.losses.advantages import gae

    v = torch.zeros(2, 3, 1, 1)
    flags = torch.zeros(2, 3, 1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gae: gamma must be in \[0, 1\], got 1.5"):
        gae(v, v, v, flags, flags, gamma=1.5, lmbda=0.95)
    with pytest.raises(ValueError, match=r"gae: lmbda must be in \[0, 1\], got -0.1"):
        gae(v, v, v, flags, flags, gamma=0.99, lmbda=-0.1)
