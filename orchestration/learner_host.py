"""A learner hosted in a process of its own, in plain Python: the :class:`orchestration.learner.PPOLearner` of
one policy, built from the run's config and tree, with the calls a driver makes from another process. Data
crosses as wire messages (:mod:`orchestration.wire`); the transport is injected: ``put`` publishes a weights
message, a pushed fragment is read with a ``fetch`` callable. :class:`orchestration.ray_learner.LearnerServer`
hosts it on Ray (``ray.put``/``ray.get``) and adds restarts and the data-parallel group. Usage::

    host = LearnerHost("agent", config, to_json(tree), to_wire(weights), put=ray.put)
    host.publish()                                    # version 0 out
    host.push(meta, lambda: message)                  # a fragment, read once its delivery is new
    result = host.train(progress, lr)                 # None, or {"metrics", "version", "weights": [handle], ...}
    version, [handle] = host.published()
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch
from tensordict import TensorDict

from core.specs import from_json
from orchestration.allocator import keep_freed_memory
from orchestration.builder import assignment_for, build_learner, policy_module
from orchestration.config import TrainConfig
from orchestration.data_parallel import data_parallel_, init_process_group, shard_by_rows
from orchestration.learner_probes import LearnerProbes
from orchestration.wire import from_wire, to_wire


def take_pushed(inbox, meta: Mapping[str, Any], fetch: Callable[[], Mapping], add: Callable) -> None:
    """Hands ``add`` the fragment of ``fetch()`` (its wire message) once ``inbox`` announced ``meta`` as a new
    delivery; counts it lost when it cannot be read (its owner died, the message is lost or malformed, a
    timeout). The fragment's leaves are views of the message (no copy; training never writes into them)."""
    if inbox.announce(meta):
        try:
            fragment = from_wire(fetch())
        except Exception:  # noqa: BLE001 - every way of not getting it counts as lost
            inbox.lost(meta)
        else:
            add(fragment)


class LearnerHost(LearnerProbes):
    """The learner of ``policy_id``, built by the one builder and started from ``initial_weights`` (a
    :func:`to_wire` message); ``put``: a weights message -> what workers fetch it by (default: the message)."""

    def __init__(self, policy_id: str, config: TrainConfig, tree_json: str, initial_weights: Mapping, *,
                 num_threads: int = 1, put: Callable[[Mapping], Any] = lambda message: message) -> None:
        torch.set_num_threads(num_threads)
        keep_freed_memory()
        tree = from_json(tree_json)
        assignment = assignment_for(config, tree)
        policy = policy_module(config, tree, assignment, policy_id)
        with torch.no_grad():
            TensorDict.from_module(policy).update_(from_wire(initial_weights))
        self.policy_id, self._put = policy_id, put
        self.learner = build_learner(config, assignment, policy_id, policy)
        self.learner.keep_last_batch = True  # LearnerProbes.last_batch
        self.learner.counters["serializations"] = 0  # weights put, over the run (a learner counter: checkpointed)
        self.restarts, self.restored_version = 0, None
        self._peers: list = []  # data-parallel ranks beside this one (a Ray server's group)
        self._weights: Any = None

    # -- data in -----------------------------------------------------------------------------------------
    def push(self, meta: Mapping[str, Any], fetch: Callable[[], Mapping]) -> int:
        """Takes one fragment (:func:`take_pushed`); returns the learner's version."""
        self.learner.counters["fragments_received"] += 1
        take_pushed(self.learner.inbox, meta, fetch,
                    lambda fragment: self.learner.inbox.add(fragment, meta, self.learner.version))
        return self.learner.version

    def settle(self, produced: Mapping[int, int]) -> int:
        return self.learner.settle({int(k): v for k, v in produced.items()})

    def new_steps(self) -> int:
        return self.learner.new_steps()

    def ready(self) -> bool:
        return self.learner.ready()

    # -- training ----------------------------------------------------------------------------------------
    def train(self, progress: float = 0.0, lr: float | None = None, take_all: bool = False,
              team_values: Mapping[int, Mapping] | None = None) -> dict | None:
        """:meth:`PPOLearner.submit`'s result, with the new weights as ``[put(message)]``; ``team_values``:
        fragment id -> a team critic's values as wire messages."""
        team = None if team_values is None else {int(f): from_wire(w) for f, w in team_values.items()}
        result = self.learner.submit(progress, lr, take_all, team).result()
        if result is not None:
            start = time.perf_counter()
            self.publish()
            result["weights"] = [self._weights]
            result["time_learn"] += time.perf_counter() - start  # the weights' way out is the learner's time too
        return result

    # -- a data-parallel group (rank 0 here), a restart -------------------------------------------------
    def join_group(self, peers: Sequence[Any], address: str, port: int,
                   send: Callable[[Any, TensorDict, float, float], Any], wait: Callable[[list], Any],
                   load: Callable[[Any, Mapping], Any]) -> None:
        """Becomes rank 0 of a group with ``peers`` (:class:`orchestration.data_parallel.DataParallelRank`s
        joining concurrently). Every batch is then split by env rows into one equal shard per rank: each peer
        gets its own through ``send(peer, shard, progress, lr)``, rank 0 trains the first, and ``wait`` (the
        list of what ``send`` returned) returns once every rank ran the same number of averaged steps. A loaded
        state reaches every peer through ``load(peer, state)``: a resumed group goes on as one (reward scaling's
        accumulators live here alone: rank 0 annotates whole fragments before it splits a batch)."""
        init_process_group(0, len(peers) + 1, address, port, self.learner.device)
        data_parallel_(self.learner)
        self._peers = list(peers)
        self._load_peers = lambda state: wait([load(peer, state) for peer in self._peers])

        def train_shards(fragments: list, progress: float, team: Any = None) -> dict:  # a team critic never
            streams = self.learner.returns      # runs with these (config); reward streams need whole fragments
            fragments = fragments if streams is None else [streams.annotated(f) for f in fragments]
            shards = shard_by_rows(fragments, len(self._peers) + 1, self.policy_id)
            lr = self.learner.optimizer.param_groups[0]["lr"]
            sent = [send(peer, shard, progress, lr) for peer, shard in zip(self._peers, shards[1:])]
            metrics = self.learner.update_([shards[0]], progress)
            wait(sent)
            self.learner.counters["env_steps_trained"] += sum(s.batch_size.numel() for s in shards[1:])
            return metrics

        self.learner.update_through = train_shards

    def resume_from(self, restarts: int, state: Mapping[str, Any] | None, version: int) -> None:
        """A re-started host: its restart count, the last state registered for it (None: none was) and the newest
        version it had published; its versions go on rising past both (a worker never sees one twice)."""
        self.restarts = int(restarts)
        if state is not None:
            self.learner.load_state_(state)
            self.restored_version = self.learner.version
        self.learner.publish_as(max(self.learner.version, int(version)) + 1)

    # -- weights out, state ------------------------------------------------------------------------------
    def publish(self) -> None:
        """Puts the newest weights once (one message per version, shared by every worker)."""
        version, weights = self.learner.published()
        self._weights = self._put(to_wire(weights, {"version": version, "policy_id": self.policy_id}))
        self.learner.counters["serializations"] += 1

    def published(self) -> tuple[int, list]:
        """``(version, [handle])`` of the newest weights (nested: a Ray caller passes the ref on unresolved)."""
        return self.learner.version, [self._weights]

    def report(self) -> dict[str, Any]:
        report = self.learner.report()
        report["counters"]["serializations"] = self.learner.counters["serializations"]
        return {**report, "restarts": self.restarts, "restored_version": self.restored_version}

    def state(self) -> dict[str, Any]:
        return self.learner.state()

    def load_state(self, state: Mapping[str, Any]) -> tuple[int, list]:
        self.learner.load_state_(state)
        if self._peers:  # their copies would go on from their own (fresh) weights and optimizer state
            self._load_peers(state)
        self.publish()
        return self.published()


__all__ = ["LearnerHost", "take_pushed"]
