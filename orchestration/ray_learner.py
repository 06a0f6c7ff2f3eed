"""Learners as Ray actors: a local :class:`PPOLearner` behind an idempotent, staleness-aware inbox.

:class:`LearnerServer` is a plain class, made remote once (:data:`RemoteLearner`). Rollout workers' sender
threads call :meth:`LearnerServer.push` with a fragment's metadata and a *nested* object ref (so Ray does
not resolve it before the call); the server fetches and copies it, which makes the fragment the learner's
own (it survives the sender's death), and acknowledges. Every fragment id ends in exactly one ledger state:

- ``accepted``: in the training pool or trained (each fragment is trained at most ``reuse_limit`` times);
- ``stale``: dropped, never trained, because its policy version lagged the learner's by more than
  ``max_staleness`` (checked on arrival and again before every training step);
- ``lost``: announced but its data could not be fetched (the owning worker died first), or never heard of
  at all: a gap in a worker's sequence (its push failed while this learner was down), or data this learner
  held when it died after its last checkpoint (see below).

A worker's pushes arrive in its sequence order (one sender thread; Ray runs one caller's actor calls in
order), so a delivery whose sequence number is not above the highest seen from that worker incarnation is a
re-delivery (a retried call): counted as a duplicate and ignored, with O(1) memory per worker; one above the
next expected number means the ones between never arrived: they are counted lost. Weights are
published once per version: one ``to_wire`` + ``ray.put`` by the learner, and every worker ``get``s the
same ref. The server is single-threaded on purpose: pushes wait while it trains, which is the
back-pressure that stops a fast fleet from flooding a slow learner.

A dead learner resumes from its last checkpoint. Learner actors are created with Ray's ``max_restarts``;
the driver keeps each learner's latest checkpoint (weights, optimizer, generator, version, counters *and*
its ledger) in the object store and registers it with a
:class:`~orchestration.ray_learner_state.LearnerCheckpoints` actor. Ray re-runs the
constructor of a dead learner; the new incarnation loads that checkpoint before it serves any call, so
pushes never reach a half-restored learner. Everything it had received since the checkpoint is then
unknown (trained into weights that died with it, or still in its pool): the sequence-gap rule and
:meth:`LearnerServer.settle` count those fragments lost, so the ledger stays exact. Versions keep rising
across a restart (the new incarnation publishes above the highest version ever published), so workers
always load its weights.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray
import torch
from tensordict import TensorDict

from core.specs import from_json
from orchestration.assignment import assign, groups_of
from orchestration.config import TrainConfig
from orchestration.learner import PPOLearner, resolve_device
from orchestration.ray_learner_state import (LearnerCheckpoints, LearnerMirrors, RemoteLearnerCheckpoints,
                                             learner_state, load_learner_state_, policy_module)
from orchestration.wire import from_wire, to_wire

ACCEPTED, STALE, LOST = "accepted", "stale", "lost"


@dataclass
class _Entry:
    """A fragment in the training pool."""

    fragment: TensorDict
    meta: dict
    steps: int
    uses: int = 0


@dataclass
class _WorkerLedger:
    """What one worker incarnation's fragments became at this learner."""

    max_seq: int = -1
    counts: dict[str, int] = field(default_factory=lambda: {ACCEPTED: 0, STALE: 0, LOST: 0})


class LearnerServer:
    """Trains one policy with PPO on fragments pushed by rollout workers.

    Args:
        policy_id: the policy this learner trains (its groups and slots come from ``config.policy_mapping``).
        config: the run (PPO settings, lr, batch size, seed, device, policy architecture and mapping).
        tree_json: the env's tree (``core.specs.to_json``), to build the policy module.
        initial_weights: the policy's starting weights as a :func:`to_wire` message (the driver seeds them
            exactly as the local backend does, so both backends start from the same parameters).
        max_staleness: drop data whose version lags the learner's by more than this.
        reuse_limit: train on a fragment at most this many times (1: each fragment once).
        resolve_timeout_s: give up fetching a pushed fragment after this long (counted lost).
        num_threads: torch threads of this process.
        checkpoints: a :class:`LearnerCheckpoints` actor: when Ray restarts this learner after a crash, it
            resumes from the checkpoint registered there (else from ``initial_weights``).
    """

    def __init__(self, policy_id: str, config: TrainConfig, tree_json: str, initial_weights: Mapping, *,
                 max_staleness: int, reuse_limit: int = 1, resolve_timeout_s: float = 30.0,
                 num_threads: int = 1, checkpoints: Any = None) -> None:
        torch.set_num_threads(num_threads)
        tree = from_json(tree_json)
        assignment = assign(tree, dict(config.policy_mapping))
        policy = policy_module(tree, config, assignment, policy_id)
        with torch.no_grad():
            TensorDict.from_module(policy).update_(from_wire(initial_weights))
        self.policy_id = policy_id
        self.learner = PPOLearner(policy, groups_of(assignment, policy_id), ppo=config.ppo, lr=config.lr,
                                  batch_steps=config.steps_per_iteration, seed=config.seed,
                                  device=resolve_device(config.device))
        self.max_staleness, self.reuse_limit, self.resolve_timeout_s = max_staleness, reuse_limit, resolve_timeout_s
        self.pool: dict[int, _Entry] = {}
        self.workers: dict[int, _WorkerLedger] = {}
        self.trained: OrderedDict[int, int] = OrderedDict()  # fragment id -> uses, the newest 100k (inspection)
        self.counters = {"duplicates": 0, "serializations": 0, "max_trained_lag": 0, "train_steps": 0, "max_uses": 0,
                         "trained_fragments": 0}
        self._last: list[_Entry] = []
        self._peers: list = []
        self._checkpoints = checkpoints
        self.restarts, self.restored_version = 0, None
        if checkpoints is not None and _reconstructed():
            self._resume(ray.get(checkpoints.resume.remote(policy_id)))
        self._publish()

    def _resume(self, info: Mapping[str, Any]) -> None:
        """A restarted incarnation: loads the last checkpoint, then versions above anything published."""
        self.restarts = int(info["restarts"])
        if info["refs"] is not None:
            checkpoint = ray.get(info["refs"][0])
            load_learner_state_(self.learner, checkpoint["learner"])
            for wid, w in checkpoint["ledger"].items():
                counts = {k: int(w[k]) for k in (ACCEPTED, STALE, LOST)}
                self.workers[int(wid)] = _WorkerLedger(int(w["max_seq"]), counts)
            self.counters.update(checkpoint["counters"])
            self.restored_version = self.learner.version
        self.learner.version = max(self.learner.version, int(info["version"])) + 1
        self.learner._published = self.learner._snapshot()

    # -- data-parallel training (RayConfig.learners_per_policy > 1) ---------------------------------------
    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, where the data-parallel group of this policy meets."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_data_parallel(self, peers: Sequence[Any], address: str, port: int) -> None:
        """Becomes rank 0 of a group with ``peers`` (:class:`DataParallelRank` actors joining concurrently)."""
        from orchestration.data_parallel import average_gradients_, init_process_group

        init_process_group(0, len(peers) + 1, address, port, self.learner.device)
        average_gradients_(self.learner.policy)
        self._peers = list(peers)

    def peer_handles(self) -> list:
        """The data-parallel peer ranks of this learner (empty without data parallelism)."""
        return list(self._peers)

    def in_sync(self) -> bool:
        """Whether every rank holds this learner's parameters (call together with the peers' ``in_sync``)."""
        from orchestration.data_parallel import check_in_sync

        return check_in_sync(self.learner.policy)

    def _train_shards(self, chosen: list[_Entry], progress: float, lr: float | None) -> dict:
        """Splits the batch by env rows into one equal shard per rank; rank 0 (here) trains the first."""
        from core.buffers import concat_fragments

        world = len(self._peers) + 1
        batch = concat_fragments([e.fragment for e in chosen])
        rows = batch.batch_size[0]
        if rows % world:
            raise ValueError(f"policy {self.policy_id!r}: {rows} env rows cannot be split evenly over {world} "
                             f"data-parallel learners (RayConfig.learners_per_policy)")
        shards = batch.split(rows // world, dim=0)
        futures = [peer.train.remote([ray.put(to_wire(shard))], progress, lr)
                   for peer, shard in zip(self._peers, shards[1:])]
        self.learner.receive(shards[0])
        metrics = self.learner.train(progress)
        ray.get(futures)  # every rank ran the same number of averaged steps
        return metrics

    # -- data in -----------------------------------------------------------------------------------------
    def push(self, meta: Mapping[str, Any], refs: Sequence[ray.ObjectRef]) -> int:
        """Takes one fragment (``meta`` + ``[ref]`` of its wire message); returns the learner's version."""
        fid, seq = int(meta["fragment_id"]), int(meta["sequence"])
        ledger = self.workers.setdefault(int(meta["worker_id"]), _WorkerLedger())
        if seq <= ledger.max_seq:  # a worker's pushes arrive in sequence order: an old one is a re-delivery
            self.counters["duplicates"] += 1
            return self.learner.version
        ledger.counts[LOST] += seq - ledger.max_seq - 1  # a gap: those pushes never arrived (module doc)
        ledger.max_seq = seq
        try:
            fragment = from_wire(ray.get(refs[0], timeout=self.resolve_timeout_s), copy=True)
        except (ray.exceptions.RayError, TimeoutError):  # owner died (OwnerDiedError), object lost, timeout
            self._set(meta, LOST)
            return self.learner.version
        if self._lag(meta) > self.max_staleness:
            self._set(meta, STALE)
        else:
            self._set(meta, ACCEPTED)
            self.pool[fid] = _Entry(fragment, dict(meta), fragment.batch_size.numel())
        return self.learner.version

    def settle(self, produced: Mapping[int, int]) -> int:
        """Counts as lost every fragment of ``produced`` (worker id -> fragments it made, all delivered or
        failed by now: the workers flushed) that never arrived here; returns how many."""
        lost = 0
        for wid, made in produced.items():
            ledger = self.workers.setdefault(int(wid), _WorkerLedger())
            if made - 1 > ledger.max_seq:
                ledger.counts[LOST] += made - 1 - ledger.max_seq
                lost += made - 1 - ledger.max_seq
                ledger.max_seq = made - 1
        return lost

    def _set(self, meta: Mapping, state: str, previous: str | None = None) -> None:
        counts = self.workers[int(meta["worker_id"])].counts
        if previous is not None:
            counts[previous] -= 1
        counts[state] += 1

    def _lag(self, meta: Mapping) -> int:
        """Versions by which the fragment's copy of this policy trailed the learner's (exact per policy)."""
        return self.learner.version - int(meta["policy_versions"][self.policy_id])

    def _drop_stale(self) -> None:
        for fid in [f for f, e in self.pool.items() if self._lag(e.meta) > self.max_staleness]:
            entry = self.pool.pop(fid)
            if entry.uses == 0:  # trained data stays "accepted"; only never-trained data is stale
                self._set(entry.meta, STALE, previous=ACCEPTED)

    def new_steps(self) -> int:
        """Env steps of fresh fragments not trained on yet."""
        self._drop_stale()
        return sum(e.steps for e in self.pool.values() if e.uses == 0)

    def ready(self) -> bool:
        """Whether a training batch is available (some new data, and a full batch counting reusable data)."""
        new = self.new_steps()
        return new > 0 and sum(e.steps for e in self.pool.values()) >= self.learner.batch_steps

    # -- training ----------------------------------------------------------------------------------------
    def _select(self, take_all: bool) -> list[_Entry]:
        fresh = [e for e in self.pool.values() if e.uses == 0]
        if take_all:  # synchronous mode: everything, in the local backend's order (worker, then sequence)
            return sorted(fresh, key=lambda e: (e.meta["worker_id"], e.meta["sequence"]))
        chosen, steps = [], 0
        reused = sorted((e for e in self.pool.values() if e.uses > 0), key=lambda e: -e.meta["sequence"])
        for entry in fresh + reused:  # new data first (arrival order), then the most recent reusable data
            if steps >= self.learner.batch_steps:
                break
            chosen.append(entry)
            steps += entry.steps
        return chosen

    def train(self, progress: float = 0.0, lr: float | None = None, take_all: bool = False) -> dict | None:
        """One PPO update if :meth:`ready` (else None); publishes the new version.

        Args:
            progress: fraction of the run done.
            lr: set this learning rate first (annealing), or None.
            take_all: train on every fresh fragment (synchronous mode) instead of one batch.

        Returns:
            ``{"metrics", "version", "weights": [ref], "fragment_ids", "time_learn"}`` or None.
        """
        if not self.ready():
            return None
        start = time.perf_counter()
        chosen = self._select(take_all)
        if lr is not None:
            self.learner.set_lr(lr)
        for entry in chosen:
            self.counters["max_trained_lag"] = max(self.counters["max_trained_lag"], self._lag(entry.meta))
        if self._peers:
            metrics = self._train_shards(chosen, progress, lr)
        else:
            for entry in chosen:
                self.learner.receive(entry.fragment)
            metrics = self.learner.train(progress)
        fids = [int(e.meta["fragment_id"]) for e in chosen]
        self.counters["trained_fragments"] += sum(e.uses == 0 for e in chosen)
        for fid, entry in zip(fids, chosen):
            entry.uses += 1
            self.trained[fid] = entry.uses
            self.counters["max_uses"] = max(self.counters["max_uses"], entry.uses)
            if entry.uses >= self.reuse_limit:
                del self.pool[fid]
        while len(self.trained) > 100_000:
            self.trained.popitem(last=False)
        self._last = chosen
        self.counters["train_steps"] += 1
        self._publish()
        return {"metrics": metrics, "version": self.learner.version, "weights": [self._weights],
                "fragment_ids": fids, "time_learn": time.perf_counter() - start}

    # -- weights out -------------------------------------------------------------------------------------
    def _publish(self) -> None:
        version, weights = self.learner.published()
        self._weights = ray.put(to_wire(weights, {"version": version, "policy_id": self.policy_id}))
        self.counters["serializations"] += 1
        if self._checkpoints is not None:  # fire and forget: the version watermark for a restart
            self._checkpoints.published.remote(self.policy_id, version)

    def published(self) -> tuple[int, list[ray.ObjectRef]]:
        """``(version, [ref])`` of the newest weights (the ref nested so callers pass it on unresolved)."""
        return self.learner.version, [self._weights]

    # -- introspection, checkpoints ----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Ledger totals, per-worker ledgers, counters and the PPO learner's counters."""
        totals = {s: sum(w.counts[s] for w in self.workers.values()) for s in (ACCEPTED, STALE, LOST)}
        return {"totals": totals, "pending_fragments": sum(1 for e in self.pool.values() if e.uses == 0),
                "workers": self._ledger(), "counters": dict(self.counters), "learner": dict(self.learner.counters),
                "version": self.learner.version, "restarts": self.restarts, "restored_version": self.restored_version}

    def _ledger(self) -> dict[int, dict[str, int]]:
        return {wid: {"max_seq": w.max_seq, **w.counts} for wid, w in self.workers.items()}

    def trained_counts(self) -> dict[int, int]:
        """Fragment id -> times trained on (the newest 100k fragments trained)."""
        return dict(self.trained)

    def last_batch(self) -> list[dict]:
        """The fragments of the last training step, as wire messages (tests and debugging)."""
        return [to_wire(e.fragment, e.meta) for e in self._last]

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint needs of this learner (:func:`learner_state`)."""
        return learner_state(self.learner)

    def checkpoint(self) -> dict[str, Any]:
        """What a restarted incarnation resumes from: :meth:`state`, the ledger and the inbox counters, taken
        together (one call: no push lands between them)."""
        return {"learner": learner_state(self.learner), "ledger": self._ledger(), "counters": dict(self.counters)}

    def load_state(self, state: Mapping[str, Any]) -> int:
        """Inverse of :meth:`state`; republishes the weights. Returns the version."""
        load_learner_state_(self.learner, state)
        self._publish()
        return self.learner.version

    def crash(self) -> None:
        """Ends this process at once, as a fatal error would (tests of learner restarts)."""
        import os

        os._exit(1)

    def pause(self, seconds: float) -> None:
        """Blocks the learner for ``seconds`` (tests: a slow learner, pushes pile up behind it)."""
        time.sleep(seconds)

    def ping(self) -> str:
        """Liveness probe; returns the node id."""
        return ray.get_runtime_context().get_node_id()


def _reconstructed() -> bool:
    """Whether this actor process is a restart (Ray 2.x reads a deprecated attribute inside: silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


#: The learner actor class, made remote once; resources are set per instance with ``.options``.
RemoteLearner = ray.remote(LearnerServer)


def learner_options(num_cpus: float, num_gpus: float | str, num_learners: int,
                    resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Ray resources of one learner: ``num_gpus="auto"`` shares the cluster's GPUs when it has any."""
    if num_gpus == "auto":
        gpus = ray.cluster_resources().get("GPU", 0.0)
        num_gpus = min(1.0, gpus / num_learners) if gpus else 0.0
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": float(num_gpus)}
    if resources:
        options["resources"] = dict(resources)
    return options


# re-exported: the learner's Ray surface in one import
__all__ = ["ACCEPTED", "LOST", "STALE", "LearnerCheckpoints", "LearnerMirrors", "LearnerServer",
           "RemoteLearner", "RemoteLearnerCheckpoints", "learner_options", "learner_state", "load_learner_state_",
           "policy_module"]
