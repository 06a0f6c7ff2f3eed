"""The staleness and reuse rules (core.buffers.staleness) as properties: the one implementation both backends'
learners call (orchestration.inbox.Inbox)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.buffers import is_fresh, is_ready, retired, select_batch, stale


@st.composite
def pools(draw, max_size: int = 12):
    k = draw(st.integers(0, max_size))
    ints = st.lists(st.integers(1, 64), min_size=k, max_size=k)
    steps = torch.tensor(draw(ints), dtype=torch.long)
    uses = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)), dtype=torch.long)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    recency = torch.tensor(draw(st.lists(st.integers(0, 1000), min_size=k, max_size=k, unique=True)),
                           dtype=torch.long)
    return steps, uses, order, recency


@given(pool=pools(), batch_steps=st.integers(1, 200), take_all=st.booleans())
def test_a_selected_batch_is_full_minimal_fresh_first_and_in_order(pool, batch_steps, take_all):
    steps, uses, order, recency = pool
    if not is_ready(steps, uses, batch_steps):
        assert not bool((uses == 0).any()) or int(steps.sum()) < batch_steps
        return
    chosen = select_batch(steps, uses, order, recency, batch_steps, take_all)
    assert len(set(chosen.tolist())) == len(chosen)  # no fragment twice in one batch
    fresh = (uses == 0).nonzero().squeeze(-1)
    if take_all:  # synchronous mode: every fresh fragment, nothing reused, in order
        assert sorted(chosen.tolist()) == sorted(fresh.tolist()) and bool((uses[chosen] == 0).all())
        assert torch.equal(order[chosen], order[chosen].sort().values)
        return
    total = int(steps[chosen].sum())
    assert total >= batch_steps  # a full batch (the pool holds one: is_ready)
    assert total - int(steps[chosen[-1]]) < batch_steps  # and not one fragment more
    is_used = (uses[chosen] > 0).tolist()
    assert is_used == sorted(is_used)  # fresh data first
    fresh_part, used_part = chosen[uses[chosen] == 0], chosen[uses[chosen] > 0]
    assert torch.equal(order[fresh_part], order[fresh_part].sort().values)  # fresh in order
    assert torch.equal(recency[used_part], recency[used_part].sort(descending=True).values)  # reused newest first
    if used_part.numel():  # reuse only tops up: every fresh fragment is in before any reused one
        assert set(fresh.tolist()) <= set(chosen.tolist())


@given(versions=st.lists(st.integers(0, 20), max_size=16), learner=st.integers(0, 20),
       max_staleness=st.integers(0, 5))
def test_stale_means_lagging_by_more_than_max_staleness_and_is_monotone(versions, learner, max_staleness):
    v = torch.tensor(versions, dtype=torch.long)
    old = stale(v, learner, max_staleness)
    assert old.tolist() == [learner - x > max_staleness for x in versions]
    assert bool((stale(v, learner + 1, max_staleness) | ~old).all())  # stale stays stale as the learner moves on
    assert bool((stale(v, learner, max_staleness + 1) <= old).all())  # a looser bound never drops more


@given(pool=pools(), batch_steps=st.integers(1, 100), reuse_limit=st.integers(1, 3), rounds=st.integers(1, 8))
def test_a_pool_run_trains_each_fragment_at_most_reuse_limit_times(pool, batch_steps, reuse_limit, rounds):
    steps, _, order, recency = pool
    uses = torch.zeros_like(steps)
    live = torch.ones_like(steps, dtype=torch.bool)
    trained = torch.zeros_like(steps)
    for _ in range(rounds):
        idx = live.nonzero().squeeze(-1)
        if not is_ready(steps[idx], uses[idx], batch_steps):
            break
        chosen = idx[select_batch(steps[idx], uses[idx], order[idx], recency[idx], batch_steps, False)]
        uses[chosen] += 1
        trained[chosen] += 1
        live &= ~retired(uses, reuse_limit)
    assert all(t <= reuse_limit for t in trained.tolist())


def test_boundaries():
    v = torch.tensor([0, 1, 2, 3, 5])
    assert is_fresh(v, 3, 1).tolist() == [False, False, True, True, True]
    assert stale(v, 3, 0).tolist() == [True, True, True, False, False]
    with pytest.raises(ValueError):
        is_fresh(v, 3, -1)
    with pytest.raises(ValueError):
        retired(v, 0)
    assert not is_ready(torch.tensor([64]), torch.tensor([1]), 32)  # reused data alone never makes a batch
