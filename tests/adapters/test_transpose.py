"""The interleaving transpose of the built-in CartPole's observations is the plain transpose, bit for bit."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.builtin.cartpole import CartPole, CartPoleConfig
from adapters.builtin.transpose import INTERLEAVE_FROM, rows_to_columns
from core.layout import ACTION, NEXT, OBSERVATION
from tensordict import TensorDict


@settings(max_examples=20, deadline=None)
@given(extra=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1))
def test_every_bit_pattern_lands_where_the_plain_transpose_puts_it(extra, seed):
    """Random 32-bit patterns (NaNs with payloads, infinities, subnormals, -0.0) on the interleaving path."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2**31, 2**31 - 1, (4, INTERLEAVE_FROM + extra), generator=g, dtype=torch.int32)
    out = rows_to_columns(rows.view(torch.float32))
    assert out.is_contiguous() and out.shape == (INTERLEAVE_FROM + extra, 4)
    assert torch.equal(out.view(torch.int32), rows.t().contiguous())


def test_other_inputs_take_the_plain_copy():
    small, wide = torch.randn(4, 16), torch.randn(4, INTERLEAVE_FROM, dtype=torch.float64)
    strided = torch.randn(4, 2 * INTERLEAVE_FROM)[:, ::2]
    for rows in (small, wide, strided):
        out = rows_to_columns(rows)
        assert out.dtype == rows.dtype and out.is_contiguous() and torch.equal(out, rows.t())


def test_a_large_cartpole_batch_observes_its_state():
    n = INTERLEAVE_FROM + 5
    env = CartPole(CartPoleConfig(num_envs=n))
    first = env.reset(seed=0)
    assert torch.equal(first.get(("agent", OBSERVATION)).squeeze(1), env.state)
    action = TensorDict({"agent": TensorDict({ACTION: torch.ones(n, 1, dtype=torch.int64)}, [n, 1])}, [n])
    before = env.state.clone()
    out = env.step(action)
    root, final = out.get(("agent", OBSERVATION)).squeeze(1), out.get((NEXT, "agent", OBSERVATION)).squeeze(1)
    assert torch.equal(root, env.state)  # after the partial reset
    assert not torch.equal(final, before) and final.is_contiguous() and root.is_contiguous()
