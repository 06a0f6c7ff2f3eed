"""A learner's inbox: the fragments delivered to it, its ledger, and the staleness and reuse rules.

Every learner (local object or Ray actor) owns one: fleets deliver fragments with their metadata, the
learner asks for its next training batch. The rules themselves are core's (:mod:`core.buffers.staleness`);
this class keeps the pool and the per-worker ledger in which every fragment ends in exactly one state:

- ``accepted``: in the training pool or trained (each fragment is trained at most ``reuse_limit`` times);
- ``stale``: dropped, never trained, because its policy version lagged the learner's by more than
  ``max_staleness`` (checked on arrival and again before every training step);
- ``lost``: announced but its data could not be fetched (the producing worker died first), or never heard of
  at all: a gap in a worker's sequence, or fragments :meth:`settle` learns were produced but never arrived.

A worker's deliveries arrive in its sequence order (one producer per worker), so a delivery whose sequence
number is not above the highest seen from that worker is a re-delivery: counted as a duplicate and
ignored, with O(1) memory per worker; one above the next expected number means the ones between never
arrived: they are counted lost.

Metadata of a delivery (what :meth:`orchestration.actor.Actor.fragment_meta` makes)::

    {"fragment_id": int, "worker_id": int, "sequence": int, "policy_versions": {policy id: version}}
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from tensordict import TensorDictBase

from core.buffers import is_ready, retired, select_batch, stale

ACCEPTED, STALE, LOST = "accepted", "stale", "lost"


@dataclass
class PoolEntry:
    """A fragment in the training pool."""

    fragment: TensorDictBase
    meta: dict
    steps: int
    arrival: int
    uses: int = 0


@dataclass
class WorkerLedger:
    """What one worker's fragments became at this learner."""

    max_seq: int = -1
    counts: dict[str, int] = field(default_factory=lambda: {ACCEPTED: 0, STALE: 0, LOST: 0})


class Inbox:
    """The pool and ledger of the learner of ``policy_id`` (module docstring).

    Args:
        policy_id: whose version in ``meta["policy_versions"]`` the staleness rule reads.
        batch_steps: env steps that make a training batch.
        max_staleness: drop data lagging by more than this many versions (None: never).
        reuse_limit: times a fragment may be trained on.
    """

    def __init__(self, policy_id: str, batch_steps: int, *, max_staleness: int | None = None,
                 reuse_limit: int = 1) -> None:
        if reuse_limit < 1:
            raise ValueError(f"reuse_limit must be >= 1, got {reuse_limit}")
        self.policy_id, self.batch_steps = policy_id, batch_steps
        self.max_staleness, self.reuse_limit = max_staleness, reuse_limit
        self.pool: dict[int, PoolEntry] = {}
        self.workers: dict[int, WorkerLedger] = {}
        self.trained: OrderedDict[int, int] = OrderedDict()  # fragment id -> uses, the newest 100k (inspection)
        self.counters = {"duplicates": 0, "max_trained_lag": 0, "max_uses": 0, "trained_fragments": 0}
        self.dropped: list[int] = []  # ids dropped as stale, never trained, since the last take_dropped()
        self._arrivals = 0

    # -- deliveries ----------------------------------------------------------------------------------------
    def announce(self, meta: Mapping[str, Any]) -> bool:
        """Registers a delivery's sequence number; False for a re-delivery (counted, to be ignored)."""
        seq = int(meta["sequence"])
        ledger = self.workers.setdefault(int(meta["worker_id"]), WorkerLedger())
        if seq <= ledger.max_seq:
            self.counters["duplicates"] += 1
            return False
        ledger.counts[LOST] += seq - ledger.max_seq - 1  # a gap: those deliveries never arrived
        ledger.max_seq = seq
        return True

    def add(self, fragment: TensorDictBase, meta: Mapping[str, Any], version: int) -> str:
        """Files an announced fragment as ``accepted`` (into the pool) or ``stale``; returns the state."""
        if self._is_stale(meta, version):
            self._count(meta, STALE)
            self.dropped.append(int(meta["fragment_id"]))
            return STALE
        self._count(meta, ACCEPTED)
        self.pool[int(meta["fragment_id"])] = PoolEntry(fragment, dict(meta), fragment.batch_size.numel(),
                                                        self._arrivals)
        self._arrivals += 1
        return ACCEPTED

    def lost(self, meta: Mapping[str, Any]) -> None:
        """An announced fragment whose data could not be fetched."""
        self._count(meta, LOST)

    def settle(self, produced: Mapping[int, int]) -> int:
        """Counts as lost every fragment of ``produced`` (worker id -> fragments it made, all delivered or
        failed by now) that never arrived here; returns how many."""
        lost = 0
        for wid, made in produced.items():
            ledger = self.workers.setdefault(int(wid), WorkerLedger())
            if made - 1 > ledger.max_seq:
                ledger.counts[LOST] += made - 1 - ledger.max_seq
                lost += made - 1 - ledger.max_seq
                ledger.max_seq = made - 1
        return lost

    # -- the rules -----------------------------------------------------------------------------------------
    def lag(self, meta: Mapping[str, Any], version: int) -> int:
        """Versions by which the fragment's copy of this policy trailed the learner's."""
        return version - int(meta["policy_versions"][self.policy_id])

    def _is_stale(self, meta: Mapping[str, Any], version: int) -> bool:
        if self.max_staleness is None:
            return False
        return bool(stale(torch.tensor([int(meta["policy_versions"][self.policy_id])]), version,
                          self.max_staleness)[0])

    def drop_stale(self, version: int) -> None:
        """Rule 1 on the pool: never-trained stale data is counted stale; trained data stays accepted."""
        if self.max_staleness is None or not self.pool:
            return
        fids = list(self.pool)
        versions = torch.tensor([int(self.pool[f].meta["policy_versions"][self.policy_id]) for f in fids])
        for fid, old in zip(fids, stale(versions, version, self.max_staleness).tolist()):
            if old:
                entry = self.pool.pop(fid)
                if entry.uses == 0:
                    self._count(entry.meta, STALE, previous=ACCEPTED)
                    self.dropped.append(fid)

    def _columns(self, entries: list[PoolEntry]):
        steps = torch.tensor([e.steps for e in entries], dtype=torch.long)
        uses = torch.tensor([e.uses for e in entries], dtype=torch.long)
        return steps, uses

    def new_steps(self, version: int) -> int:
        """Env steps of fresh fragments not trained on yet."""
        self.drop_stale(version)
        return sum(e.steps for e in self.pool.values() if e.uses == 0)

    def ready(self, version: int) -> bool:
        """Rule 2: a training batch is available."""
        self.drop_stale(version)
        entries = list(self.pool.values())
        return bool(entries) and is_ready(*self._columns(entries), self.batch_steps)

    def take_dropped(self) -> list[int]:
        """The ids dropped as stale since the last call (asynchronous mode gives their sampling credit back)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def take(self, version: int, take_all: bool) -> list[PoolEntry]:
        """Rule 3: the entries of the next batch (call when :meth:`ready`, or with ``take_all`` on any fresh
        data); marks them used and retires what reached ``reuse_limit`` (rule 4)."""
        self.drop_stale(version)
        entries = list(self.pool.values())
        if not entries:
            return []
        steps, uses = self._columns(entries)
        # synchronous mode trains in (worker, sequence) order on every backend; async in arrival order
        order = torch.tensor([(e.meta["worker_id"] << 32) | e.meta["sequence"] if take_all else e.arrival
                              for e in entries], dtype=torch.long)
        recency = torch.tensor([e.arrival for e in entries], dtype=torch.long)  # across workers: arrival order
        chosen = [entries[i] for i in select_batch(steps, uses, order, recency, self.batch_steps, take_all).tolist()]
        for entry in chosen:
            fid = int(entry.meta["fragment_id"])
            self.counters["max_trained_lag"] = max(self.counters["max_trained_lag"], self.lag(entry.meta, version))
            self.counters["trained_fragments"] += entry.uses == 0
            entry.uses += 1
            self.trained[fid] = entry.uses
            self.counters["max_uses"] = max(self.counters["max_uses"], entry.uses)
        now_retired = retired(torch.tensor([e.uses for e in chosen], dtype=torch.long), self.reuse_limit)
        for entry, done in zip(chosen, now_retired.tolist()):
            if done:
                del self.pool[int(entry.meta["fragment_id"])]
        while len(self.trained) > 100_000:
            self.trained.popitem(last=False)
        return chosen

    # -- ledger --------------------------------------------------------------------------------------------
    def _count(self, meta: Mapping[str, Any], state: str, previous: str | None = None) -> None:
        counts = self.workers.setdefault(int(meta["worker_id"]), WorkerLedger()).counts
        if previous is not None:
            counts[previous] -= 1
        counts[state] += 1

    def ledger(self) -> dict[int, dict[str, int]]:
        """Worker id -> ``{"max_seq", "accepted", "stale", "lost"}``."""
        return {wid: {"max_seq": w.max_seq, **w.counts} for wid, w in self.workers.items()}

    def report(self) -> dict[str, Any]:
        """Ledger totals, per-worker ledgers, pending fragments and counters."""
        totals = {s: sum(w.counts[s] for w in self.workers.values()) for s in (ACCEPTED, STALE, LOST)}
        return {"totals": totals, "pending_fragments": sum(1 for e in self.pool.values() if e.uses == 0),
                "workers": self.ledger(), "counters": dict(self.counters)}

    def state(self) -> dict[str, Any]:
        """The ledger and counters as JSON values. The pool's data is not part of it, so its fragments never
        trained on are ``lost`` in the state: a restored inbox starts with an empty pool."""
        ledger = self.ledger()
        for entry in self.pool.values():
            if entry.uses == 0:
                counts = ledger[int(entry.meta["worker_id"])]
                counts[ACCEPTED], counts[LOST] = counts[ACCEPTED] - 1, counts[LOST] + 1
        return {"ledger": {str(k): v for k, v in ledger.items()}, "counters": dict(self.counters)}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state` (the pool is emptied)."""
        self.pool.clear()
        self.workers = {int(wid): WorkerLedger(int(w["max_seq"]), {k: int(w[k]) for k in (ACCEPTED, STALE, LOST)})
                        for wid, w in state["ledger"].items()}
        self.counters.update({k: int(v) for k, v in state["counters"].items()})


__all__ = ["ACCEPTED", "LOST", "STALE", "Inbox", "PoolEntry", "WorkerLedger"]
