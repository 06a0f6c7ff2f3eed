"""Train batches from fragments: concatenation, flattening, minibatches (pure functions; staleness and reuse
rules are in :mod:`core.buffers.staleness`).

Layout: fragments are ``[env, time]`` (groups ``[env, time, agent]``); a flat batch is ``[N]`` transitions
(groups ``[N, agent]``). The agent dim is never shuffled: all agents of a transition travel together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from tensordict import TensorDict

from core.layout import ACTION_MASK, MASK, group_of


def _layout(td: TensorDict) -> dict:
    """Key -> (dtype, shape without the env dim) for every leaf, and batch sizes of sub-TensorDicts."""
    out = {}
    for key, value in td.items(include_nested=True):
        if isinstance(value, TensorDict):
            out[key] = ("batch", tuple(value.batch_size[1:]))
        else:
            out[key] = (value.dtype, tuple(value.shape[1:]))
    return out


def concat_fragments(fragments: Sequence[TensorDict]) -> TensorDict:
    """Concatenates ``[E_i, T]`` fragments along ``env`` into one ``[sum E_i, T]`` train batch.

    A single fragment comes back as a shallow copy (new TensorDict nodes, the same tensors): nothing to
    concatenate, and copying its tensors cost ~0.5 ms per CartPole iteration. Entries added to the result do
    not reach the fragment; the caller must not write into its tensors in place (nothing in core does).

    Raises:
        ValueError: no fragments, or a fragment whose keys, dtypes, or shapes (beyond the env dim, incl.
            group batch sizes) differ from the first one's; the message names the fragment and key.
    """
    if not fragments:
        raise ValueError("concat_fragments needs at least one fragment")
    if len(fragments) == 1:
        return fragments[0].copy()
    ref = _layout(fragments[0])
    for i, frag in enumerate(fragments[1:], 1):
        if tuple(frag.batch_size[1:]) != tuple(fragments[0].batch_size[1:]) or frag.batch_dims != fragments[0].batch_dims:
            raise ValueError(
                f"fragment {i} has batch {tuple(frag.batch_size)}, fragment 0 has {tuple(fragments[0].batch_size)}"
            )
        other = _layout(frag)
        if other.keys() != ref.keys():
            missing, extra = sorted(map(str, ref.keys() - other.keys())), sorted(map(str, other.keys() - ref.keys()))
            raise ValueError(f"fragment {i} keys differ from fragment 0: missing {missing}, unexpected {extra}")
        for key, spec in ref.items():
            if other[key] != spec:
                raise ValueError(f"fragment {i} key {key!r}: {other[key]} vs fragment 0 {spec} (dtype/shape past env)")
    return torch.cat(list(fragments), dim=0)


def flatten_transitions(rollout: TensorDict) -> TensorDict:
    """``[E, T]`` -> ``[E * T]`` transitions (env-major); groups become ``[E * T, A]``. ``[N]`` passes through."""
    if rollout.batch_dims == 1:
        return rollout
    if rollout.batch_dims != 2:
        raise ValueError(f"expected [env, time] or [N], got batch {tuple(rollout.batch_size)}")
    return rollout.reshape(-1)


def drop_trivial_masks(flat: TensorDict, group: str) -> TensorDict:
    """``flat`` without an all-True agent mask or action mask of ``group`` (the unmasked loss path is cheaper);
    ``flat`` itself when there is none."""
    g = group_of(flat, group)
    trivial = [k for k in (MASK, ACTION_MASK) if k in g.keys() and bool(g.get(k).all())]
    if not trivial:
        return flat
    out = flat.copy()
    out.set(group, g.exclude(*trivial))
    return out


def _order(flat: TensorDict, generator: torch.Generator, drop_empty: bool, group: str | None) -> torch.Tensor:
    """The shuffled indices of the kept transitions of ``flat`` ``[N]`` (one ``randperm``), on its device."""
    n = flat.batch_size[0]
    if drop_empty:
        if group is None:
            raise ValueError("drop_empty=True needs the group whose mask decides")
        mask = group_of(flat, group).get(MASK)
        present = mask.flatten(1).any(-1) if mask.dim() > 1 else mask  # [N]: any agent of the row present
        keep = present.nonzero().squeeze(-1).cpu()
        order = keep[torch.randperm(keep.shape[0], generator=generator)]
    else:
        order = torch.randperm(n, generator=generator)
    return order.to(flat.device)


def minibatches(
    batch: TensorDict,
    minibatch_size: int,
    generator: torch.Generator,
    *,
    drop_empty: bool = False,
    group: str | None = None,
    reuse: dict | None = None,
) -> list[TensorDict]:
    """Shuffles the transitions of ``batch`` into minibatches of ``minibatch_size`` (the last may be smaller).

    The rule PPO trains with (:func:`core.losses.ppo_update_` takes these minibatches once per epoch, copied a
    chunk at a time by :func:`gathered_minibatches`): one ``randperm`` of the kept transitions, one index of the
    whole batch, then ``split(minibatch_size)`` (notes/tensordict-hot-paths.md, pattern 4). Every kept
    transition lands in exactly one minibatch, every minibatch but the last holds exactly ``minibatch_size``;
    the same generator state gives the same minibatches.

    Args:
        batch: ``[E, T]`` (flattened first) or ``[N]`` transitions.
        minibatch_size: size of every minibatch but the last, >= 1.
        generator: source of the permutation (CPU generator; indices move to the batch's device).
        drop_empty: drop transitions where no agent of ``group`` is present (``(group, "mask")`` all
            False). Masked agents in kept transitions keep their mask.
        group: the group whose mask ``drop_empty`` reads.
        reuse: a dict the caller keeps across epochs of one batch: the shuffled copy is then written into the
            storage of the previous call's (same rows kept) instead of new storage. The previous call's
            minibatches must no longer be in use: they are overwritten. It saves the allocation and keeps
            the allocator from scattering one large copy per epoch among the small blocks of the steps (for
            callers that keep whole-batch copies; PPO copies chunks instead).

    Returns:
        A list of ``[n_i]`` TensorDicts (groups ``[n_i, A]``); empty if nothing is kept.
    """
    if minibatch_size < 1:
        raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
    flat = flatten_transitions(batch)
    order = _order(flat, generator, drop_empty, group)
    if order.shape[0] == 0:
        return []
    shuffled = None if reuse is None else reuse.get("shuffled")
    if shuffled is None or shuffled.batch_size[0] != order.shape[0]:
        shuffled = flat[order]
        if reuse is not None:
            reuse["shuffled"] = shuffled
    else:
        for key, into in shuffled.items(True, True):
            torch.index_select(flat.get(key), 0, order, out=into)
    return list(shuffled.split(minibatch_size, dim=0))


#: Transitions :func:`gathered_minibatches` copies at a time (rounded down to whole minibatches): at CartPole's
#: 40 bytes per shuffled transition, 330 KB, against 40 MB for a whole batch of 16,384 envs x 64 steps.
GATHER_ROWS = 1 << 13


def gathered_minibatches(
    batch: TensorDict,
    minibatch_size: int,
    generator: torch.Generator,
    *,
    drop_empty: bool = False,
    group: str | None = None,
    chunk_rows: int = GATHER_ROWS,
) -> Iterator[TensorDict]:
    """The minibatches of :func:`minibatches` (same generator state: the same transitions in the same order),
    copied out of ``batch`` a chunk of minibatches at a time, when the iteration reaches the chunk.

    :func:`minibatches` copies the whole batch in shuffled order, then splits the copy, so for the length of
    an epoch the batch is held twice over (at 16,384 CartPoles x 64 steps, 40 of the 150 bytes an update
    holds per transition). Here a chunk of about ``chunk_rows`` transitions is copied (one index op per leaf
    and chunk) and split into minibatch views: the copy is bounded by the chunk, and the index ops are as
    few as :func:`minibatches`' for batches of up to ``chunk_rows`` (``benchmarks/ppo_update.py`` and
    ``benchmarks/transition_memory.py`` measure both sides). The permutation is drawn by the call.

    Args and errors: as :func:`minibatches` (no ``reuse``); ``chunk_rows``: transitions copied at a time,
    rounded down to a multiple of ``minibatch_size`` (at least one minibatch).

    Returns:
        An iterator of ``[n_i]`` TensorDicts (groups ``[n_i, A]``): views of their chunk's copy (writing into
        them never reaches ``batch``); empty if nothing is kept.
    """
    if minibatch_size < 1:
        raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
    flat = flatten_transitions(batch)
    order = _order(flat, generator, drop_empty, group)  # drawn now, as minibatches() draws it
    if order.shape[0] == 0:
        return iter(())
    per_chunk = max(1, chunk_rows // minibatch_size) * minibatch_size
    return (mb for rows in order.split(per_chunk) for mb in flat[rows].split(minibatch_size, dim=0))
