"""Train batches: partition, alignment, masks and determinism of minibatches; concatenation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.buffers import concat_fragments, flatten_transitions, gathered_minibatches, minibatches
from core.layout import MASK, NEXT, POLICY_VERSION
from tests.strategies import GROUP, rollouts

seeds = st.integers(0, 2**32 - 1)


# TensorDict.numel() is 1 for an empty batch in tensordict 0.14: count with batch_size.numel() instead.


def uids(mbs) -> torch.Tensor:
    return torch.cat([mb[GROUP, "uid"].reshape(-1) for mb in mbs]) if mbs else torch.empty(0, dtype=torch.long)


@given(rollout=rollouts(), data=st.data(), seed=seeds)
def test_minibatches_partition_the_batch(rollout, data, seed):
    n = rollout.batch_size.numel()
    size = data.draw(st.integers(1, n + 2), label="minibatch_size")
    mbs = minibatches(rollout, size, torch.Generator().manual_seed(seed))
    sizes = [mb.batch_size[0] for mb in mbs]
    assert len(mbs) == -(-n // size) and sum(sizes) == n
    assert all(s == size for s in sizes[:-1]) and 1 <= sizes[-1] <= size  # PPO's rule: split(minibatch_size)
    # each (env, step, agent) exactly once
    assert torch.equal(uids(mbs).sort().values, rollout[GROUP, "uid"].reshape(-1).sort().values)


@given(rollout=rollouts(max_agents=4), seed=seeds)
def test_agents_of_a_transition_stay_together_with_their_metadata(rollout, seed):
    e, t, a = rollout[GROUP].batch_size
    for mb in minibatches(rollout, 3, torch.Generator().manual_seed(seed)):
        assert tuple(mb[GROUP].batch_size) == (mb.batch_size[0], a)
        uid = mb[GROUP, "uid"].squeeze(-1)  # [n, A]
        assert torch.all(uid[:, 1:] - uid[:, :-1] == 1) and torch.all(uid[:, 0] % a == 0)
        env = uid[:, 0] // (t * a)
        assert torch.equal(mb[POLICY_VERSION, GROUP], rollout[POLICY_VERSION, GROUP][env, 0])
        assert torch.equal(mb[NEXT, GROUP, "reward"], mb[GROUP, "uid"].float())  # next travels along


@given(rollout=rollouts(), data=st.data(), seed=seeds)
def test_drop_empty_drops_exactly_the_all_masked_transitions(rollout, data, seed):
    size = data.draw(st.integers(1, rollout.batch_size.numel()), label="minibatch_size")
    mbs = minibatches(rollout, size, torch.Generator().manual_seed(seed), drop_empty=True, group=GROUP)
    flat = flatten_transitions(rollout)
    occupied = flat[GROUP, MASK].any(-1)
    expected = flat[GROUP, "uid"][occupied].reshape(-1).sort().values
    assert torch.equal(uids(mbs).sort().values, expected)
    if mbs:
        sizes = [mb.batch_size[0] for mb in mbs]
        assert all(s == size for s in sizes[:-1]) and 1 <= sizes[-1] <= size
    for mb in mbs:  # masked agents of kept transitions keep their flag
        kept_uid = mb[GROUP, "uid"].squeeze(-1)[:, 0] // flat[GROUP].batch_size[1]
        assert torch.equal(mb[GROUP, MASK], flat[GROUP, MASK][kept_uid])
        assert mb[GROUP, MASK].any(-1).all()


@given(rollout=rollouts(), seed=seeds)
def test_same_seed_same_minibatches(rollout, seed):
    a = minibatches(rollout, 2, torch.Generator().manual_seed(seed))
    b = minibatches(rollout, 2, torch.Generator().manual_seed(seed))
    assert torch.equal(uids(a), uids(b)) and [m.batch_size for m in a] == [m.batch_size for m in b]


@given(rollout=rollouts(max_envs=2, max_steps=3, max_agents=2))
def test_different_seeds_give_different_orders(rollout):
    # Deterministic, not flaky: seeds are fixed, and 12 of them all giving one order has probability
    # 2**-11 even at N = 2 (and the 12 seeds differ for every N in 2..199 with torch 2.13, checked offline)
    n = rollout.batch_size.numel()
    orders = {tuple(uids(minibatches(rollout, n, torch.Generator().manual_seed(s))).tolist()) for s in range(12)}
    assert (len(orders) >= 2) == (rollout.batch_size.numel() >= 2)


def test_minibatch_argument_errors():
    with pytest.raises(ValueError, match="minibatch_size"):
        minibatches(flat_example(), 0, torch.Generator())
    with pytest.raises(ValueError, match="group"):
        minibatches(flat_example(), 1, torch.Generator(), drop_empty=True)


def flat_example():
    return TensorDict({GROUP: TensorDict({MASK: torch.ones(4, 2, dtype=torch.bool)}, [4, 2])}, [4])


@given(a=rollouts(max_envs=3), b_envs=st.integers(1, 3))
def test_concat_fragments_stacks_envs_and_refuses_mismatches(a, b_envs):
    e, t = a.batch_size
    b = a[:1].expand(b_envs, t).clone()
    cat = concat_fragments([a, b])
    assert tuple(cat.batch_size) == (e + b_envs, t)
    assert tuple(cat[GROUP].batch_size) == (e + b_envs, t, a[GROUP].batch_size[2])
    assert torch.equal(cat[GROUP, "uid"][:e], a[GROUP, "uid"])
    missing = b.exclude((GROUP, MASK))
    with pytest.raises(ValueError, match="mask"):
        concat_fragments([a, missing])
    wrong_dtype = b.clone()
    wrong_dtype[GROUP, "uid"] = wrong_dtype[GROUP, "uid"].int()
    with pytest.raises(ValueError, match="uid"):
        concat_fragments([a, wrong_dtype])
    with pytest.raises(ValueError, match="batch"):
        concat_fragments([a, a[:, :0]])
    with pytest.raises(ValueError):
        concat_fragments([])


def test_concat_of_one_fragment_is_a_shallow_copy():
    a = TensorDict({GROUP: TensorDict({"x": torch.arange(6.0).reshape(2, 3, 1, 1)}, [2, 3, 1])}, [2, 3])
    out = concat_fragments([a])
    assert out is not a and out[GROUP] is not a[GROUP] and torch.equal(out[GROUP, "x"], a[GROUP, "x"])
    out.get(GROUP).set("v", torch.zeros(2, 3, 1, 1))  # what a learner adds (values, advantages) ...
    assert "v" not in a[GROUP].keys()  # ... does not reach the fragment other learners may share


@given(rollout=rollouts(), seed=seeds, epochs=st.integers(2, 4), drop_empty=st.booleans())
def test_reused_storage_gives_the_same_minibatches_in_the_same_storage(rollout, seed, epochs, drop_empty):
    """``reuse``: each epoch's shuffled copy is written over the last one's storage, with the same contents
    as a fresh copy (same generator draws)."""
    fresh_g, reused_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    reuse: dict = {}
    kwargs = dict(drop_empty=drop_empty, group=GROUP)
    first_ptr = None
    for _ in range(epochs):
        fresh = minibatches(rollout, 3, fresh_g, **kwargs)
        reused = minibatches(rollout, 3, reused_g, reuse=reuse, **kwargs)
        assert len(fresh) == len(reused)
        for a, b in zip(fresh, reused):
            assert (a == b).all()
        if reused:
            ptr = reused[0][GROUP, "observation"].data_ptr()
            first_ptr = ptr if first_ptr is None else first_ptr
            assert ptr == first_ptr  # written in place, not reallocated


@given(rollout=rollouts(), data=st.data(), seed=seeds, epochs=st.integers(1, 3), drop_empty=st.booleans())
def test_gathered_minibatches_are_the_minibatches_chunk_by_chunk(rollout, data, seed, epochs, drop_empty):
    """``gathered_minibatches`` (what PPO trains on) yields exactly ``minibatches``' minibatches, epoch after
    epoch from one generator, whatever the chunk size; each chunk is one copy the minibatches are views of."""
    n = rollout.batch_size.numel()
    size = data.draw(st.integers(1, n + 2), label="minibatch_size")
    chunk = data.draw(st.integers(1, 2 * n + 2), label="chunk_rows")
    whole_g, chunked_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    kwargs = dict(drop_empty=drop_empty, group=GROUP)
    for _ in range(epochs):
        whole = minibatches(rollout, size, whole_g, **kwargs)
        chunked = list(gathered_minibatches(rollout, size, chunked_g, chunk_rows=chunk, **kwargs))
        assert [mb.batch_size for mb in chunked] == [mb.batch_size for mb in whole]
        for a, b in zip(whole, chunked):
            assert (a == b).all()
        per_chunk = max(1, chunk // size)  # minibatches sharing one copy
        storages = [mb[GROUP, "observation"].untyped_storage().data_ptr() for mb in chunked]
        assert len(set(storages)) == -(-len(chunked) // per_chunk)
        assert not {mb[GROUP, "observation"].untyped_storage().data_ptr() for mb in chunked} & {
            rollout[GROUP, "observation"].untyped_storage().data_ptr()}  # copies, never the batch itself


def test_gathered_minibatches_copy_one_chunk_at_a_time():
    """The point of chunks: a minibatch's copy is as large as its chunk, not the batch, and it is made only
    when the iteration reaches it (the batch itself is left as it is)."""
    n = 1000
    batch = TensorDict({GROUP: TensorDict({"observation": torch.arange(n * 4.0).reshape(n, 1, 4)}, [n, 1])}, [n])
    it = gathered_minibatches(batch, 10, torch.Generator().manual_seed(0), chunk_rows=100)
    first = next(it)
    assert first[GROUP, "observation"].untyped_storage().nbytes() == 100 * 4 * 4  # one chunk, not n rows
    batch[GROUP, "observation"].zero_()  # later chunks are copied when reached: they see this
    rest = list(it)
    assert len(rest) == 99
    assert all(mb[GROUP, "observation"].abs().sum() == 0 for mb in rest[9:])  # chunks after the first
    assert all((mb[GROUP, "observation"].abs().sum(-1) > 0).all() for mb in rest[:9])  # copied with the first
    with pytest.raises(ValueError, match="minibatch_size"):
        gathered_minibatches(batch, 0, torch.Generator())


def test_gathered_minibatches_of_nothing_kept_are_none():
    """An empty batch, or one whose agents are all absent with ``drop_empty``: no minibatch (as ``minibatches``)."""
    for n, present in ((0, True), (6, False)):
        group = TensorDict({"observation": torch.zeros(n, 2, 3), MASK: torch.full((n, 2), present)}, [n, 2])
        batch = TensorDict({GROUP: group}, [n])
        for drop_empty in (False, True) if n == 0 else (True,):
            kwargs = dict(drop_empty=drop_empty, group=GROUP)
            assert minibatches(batch, 4, torch.Generator(), **kwargs) == []
            assert list(gathered_minibatches(batch, 4, torch.Generator(), **kwargs)) == []


def test_a_group_the_batch_does_not_have_is_named_with_the_groups_it_has():
    """A misspelt group gave ``'NoneType' object has no attribute 'batch_size'`` in GAE, the PPO update and the
    minibatches."""
    import pytest
    import torch
    from tensordict import TensorDict

    from core.buffers import minibatches
    from core.losses.advantages import with_gae

    rollout = TensorDict({"agent": TensorDict({"mask": torch.ones(2, 3, 1, dtype=torch.bool)}, [2, 3, 1])}, [2, 3])
    with pytest.raises(KeyError, match=r"no agent group 'agents' in the TensorDict \(its groups: \['agent'\]\)"):
        with_gae(rollout, "agents", 0.99, 0.95)
    with pytest.raises(KeyError, match="no agent group 'agents'"):
        minibatches(rollout.reshape(-1), 2, torch.Generator(), drop_empty=True, group="agents")
