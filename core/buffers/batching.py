"""Train batches from fragments: concatenation, flattening, minibatches, staleness (pure functions).

Layout: fragments are ``[env, time]`` (groups ``[env, time, agent]``); a flat batch is ``[N]`` transitions
(groups ``[N, agent]``). The agent dim is never shuffled: all agents of a transition travel together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from core.layout import MASK, POLICY_VERSION


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


def minibatches(
    batch: TensorDict,
    minibatch_size: int,
    generator: torch.Generator,
    *,
    drop_empty: bool = False,
    group: str | None = None,
) -> list[TensorDict]:
    """Shuffles the transitions of ``batch`` into ``ceil(N / minibatch_size)`` near-equal minibatches.

    One ``randperm`` per call (one epoch), one index of the whole batch, then ``split``
    (notes/tensordict-hot-paths.md, pattern 4). Every kept transition lands in exactly one minibatch,
    sizes differ by at most one and none exceeds ``minibatch_size``; the same generator state gives the
    same minibatches.

    Args:
        batch: ``[E, T]`` (flattened first) or ``[N]`` transitions.
        minibatch_size: upper bound on a minibatch's size, >= 1.
        generator: source of the permutation (CPU generator; indices move to the batch's device).
        drop_empty: drop transitions where no agent of ``group`` is present (``(group, "mask")`` all
            False). Masked agents in kept transitions keep their mask.
        group: the group whose mask ``drop_empty`` reads.

    Returns:
        A list of ``[n_i]`` TensorDicts (groups ``[n_i, A]``); empty if nothing is kept.
    """
    if minibatch_size < 1:
        raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
    flat = flatten_transitions(batch)
    n = flat.batch_size[0]
    if drop_empty:
        if group is None:
            raise ValueError("drop_empty=True needs the group whose mask decides")
        mask = flat.get((group, MASK))
        keep = mask.reshape(n, -1).any(-1).nonzero().squeeze(-1).cpu()
        order = keep[torch.randperm(keep.shape[0], generator=generator)]
    else:
        order = torch.randperm(n, generator=generator)
    kept = order.shape[0]
    if kept == 0:
        return []
    chunks = math.ceil(kept / minibatch_size)
    sizes = [kept // chunks + (1 if i < kept % chunks else 0) for i in range(chunks)]
    return list(flat[order.to(flat.device)].split(sizes, dim=0))


def is_fresh(policy_version: torch.Tensor, learner_version: int, max_staleness: int) -> torch.Tensor:
    """True where data came from a policy at most ``max_staleness`` versions behind the learner (seed 004).

    ``policy_version`` is any int tensor; a version ahead of the learner counts as fresh.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return (learner_version - policy_version) <= max_staleness


def filter_stale(
    batch: TensorDict, group: str, learner_version: int, max_staleness: int
) -> tuple[TensorDict, int]:
    """Drops transitions whose ``(POLICY_VERSION, group)`` is more than ``max_staleness`` behind.

    ``[E, T]`` batches drop whole env rows (a row whose any step is stale), keeping the time structure that
    GAE needs; ``[N]`` batches drop single transitions.

    Returns:
        ``(kept, num_dropped)``: the kept TensorDict and the number of transitions (env steps) dropped.
    """
    fresh = is_fresh(batch.get((POLICY_VERSION, group)), learner_version, max_staleness)
    if batch.batch_dims == 2:
        keep = fresh.all(dim=1)
        return batch[keep], int((~keep).sum()) * batch.batch_size[1]
    if batch.batch_dims != 1:
        raise ValueError(f"expected [env, time] or [N], got batch {tuple(batch.batch_size)}")
    return batch[fresh], int((~fresh).sum())
