"""Which pooled fragments a learner trains on: seed 004's staleness and reuse rules, written once.

A learner keeps a pool of fragments. Per fragment ``k`` (1-D tensors of length ``K``, int64):

- ``versions[k]``: the version of the learner's policy that acted in the fragment;
- ``uses[k]``: how many training steps already used it;
- ``steps[k]``: its env steps;
- ``order[k]``: its rank for training (smaller first; e.g. (worker, sequence) order in synchronous mode,
  arrival order in asynchronous mode), all distinct;
- ``recency[k]``: how recent it is (larger is newer; reused data is taken newest first).

The rules, used by every backend (the local learner and the Ray learner actor run the same code):

1. **stale** (:func:`stale`): a fragment whose version lags the learner's by more than ``max_staleness`` is
   never trained on again (dropped; counted stale when it was never used).
2. **ready** (:func:`is_ready`): the pool holds fresh data (never used) and at least ``batch_steps`` env steps
   counting reusable data: reused data only tops up a batch, it never makes one alone.
3. **selection** (:func:`select_batch`): synchronous mode (``take_all``) takes every never-used fragment in
   ``order``; asynchronous mode takes never-used fragments in ``order``, then used ones newest first, until
   the batch holds ``batch_steps`` env steps (and not one fragment more).
4. **retirement** (:func:`retired`): a fragment used ``reuse_limit`` times leaves the pool.
"""

from __future__ import annotations

import torch


def is_fresh(policy_version: torch.Tensor, learner_version: int, max_staleness: int) -> torch.Tensor:
    """True where data came from a policy at most ``max_staleness`` versions behind the learner.

    ``policy_version`` is any int tensor; a version ahead of the learner counts as fresh.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return (learner_version - policy_version) <= max_staleness


def stale(versions: torch.Tensor, learner_version: int, max_staleness: int) -> torch.Tensor:
    """Bool ``[K]``: fragments too old to train on (rule 1)."""
    return ~is_fresh(versions, learner_version, max_staleness)


def is_ready(steps: torch.Tensor, uses: torch.Tensor, batch_steps: int) -> bool:
    """Rule 2 on a pool without stale entries: fresh data, and a full batch counting reusable data."""
    return bool((uses == 0).any()) and int(steps.sum()) >= batch_steps


def select_batch(steps: torch.Tensor, uses: torch.Tensor, order: torch.Tensor, recency: torch.Tensor,
                 batch_steps: int, take_all: bool) -> torch.Tensor:
    """Rule 3: indices ``[k]`` into the pool of the fragments of the next training batch, in batch order.

    Call on a pool without stale entries that :func:`is_ready` accepts.
    """
    fresh = (uses == 0).nonzero().squeeze(-1)
    fresh = fresh[torch.argsort(order[fresh], stable=True)]
    if take_all:
        return fresh
    used = (uses > 0).nonzero().squeeze(-1)
    used = used[torch.argsort(recency[used], descending=True, stable=True)]
    candidates = torch.cat([fresh, used])
    before = torch.cumsum(steps[candidates], 0) - steps[candidates]  # steps already chosen before each one
    return candidates[before < batch_steps]


def retired(uses: torch.Tensor, reuse_limit: int) -> torch.Tensor:
    """Rule 4: bool ``[K]``, fragments that have been trained on ``reuse_limit`` times."""
    if reuse_limit < 1:
        raise ValueError(f"reuse_limit must be >= 1, got {reuse_limit}")
    return uses >= reuse_limit


__all__ = ["is_fresh", "is_ready", "retired", "select_batch", "stale"]
