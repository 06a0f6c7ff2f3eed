"""External environments as a fleet (seed 002): the same Trainer trains on simulators that connect over the
network. The fleet owns the server (:mod:`orchestration.external_server`), the batched inference service
that acts for every connection (:mod:`orchestration.inference`), the launcher of simulators when a command is
given (:mod:`orchestration.external_launcher`), and hands the fragments the episodes make to the learners.

Implements the Fleet protocol (:mod:`orchestration.fleet`; usage loop there). Each episode lane is a worker
id of its own (``reported``: lane -> fragments made). Fragments are delivered in the trainer's thread (from a
queue the connection threads fill), so learners are never called concurrently. ``collect`` waits until the
asked-for steps arrived; ``pump`` delivers what is queued (waiting a moment when nothing is). New weights
reach the inference service between two of its batches.

Nothing of a running episode is checkpointed: a resumed run starts every lane afresh (see
``resume_gaps``) and simulators reconnect to the new server.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tensordict import TensorDictBase

from core.specs import to_json
from orchestration.builder import assignment_for, build_learners, build_policies
from orchestration.config import TrainConfig
from adapters.external.codec import TreeCodec
from orchestration.external_episodes import Lanes
from orchestration.external_launcher import NoSimulatorData, SimulatorLauncher
from orchestration.external_server import ExternalServer
from orchestration.fleet import CollectionInterrupted, Weights
from orchestration.inference import InferenceConfig, InferenceService
from orchestration.statistics import EpisodeStatistics

_PUMP_WAIT_S = 0.05  # how long an async pump waits for a first fragment before handing back to the trainer
_INTERRUPT_GRACE_S = 2.0  # seconds without a simulator acting before a signal gives up a collection


class ExternalFleet:
    """Fragments from external simulators (module docstring).

    Args:
        server: a started server with a service and lanes attached.
        service: the inference service that acts for the connections.
        lanes: the recording, whose ``deliver`` is :meth:`enqueue`.
        learners: policy id -> learner receiving every fragment (the learning ones).
        launcher: simulators to keep running, or None when they connect by themselves.
        wait_s: longest a collect or pump waits with no fragment at all (0: forever).
        clock: monotonic seconds, read for those waits and a signal's grace (time is an argument).
    """

    restarts = 0
    dead: set[int] = set()
    resume_gaps = ("an external run's open episodes are not checkpointed, and its server's counters "
                   "(env/external_*, fragments_produced) start again",)

    def __init__(self, server: ExternalServer, service: InferenceService, lanes: Lanes, learners: Mapping[str, Any],
                 *, launcher: SimulatorLauncher | None = None, wait_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.server, self.service, self.lanes, self.launcher = server, service, lanes, launcher
        self.learners = dict(learners)
        self.wait_s = wait_s
        self.fragment_steps = lanes.fragment_length
        self.reported: dict[int, int] = {}
        self.dead = set()
        self.stats = EpisodeStatistics()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._clock = clock
        self._last_data = self._last_activity = clock()
        self._errors_at_data: dict[str, int] = {}  # the server's error counts when data last came (refusals since)
        self._activity = -1  # act requests and uploaded steps the server had counted when last looked at
        self._interrupted = False

    def enqueue(self, fragment, meta: dict, episodes: dict) -> None:
        """Called by connection threads with every fragment they complete."""
        self._queue.put((fragment, meta, episodes))

    # -- delivery ----------------------------------------------------------------------------------------------
    def _deliver(self, block_s: float, check: bool = True, fresh: Mapping[str, int] | None = None,
                 limit: int | None = None) -> int:
        """Delivers queued fragments (waiting up to ``block_s`` for the first); returns env steps delivered.
        ``fresh`` (sync): policy id -> the version now acting; only fragments acted by those versions alone count
        as delivered steps (older ones still go to the learners, whose staleness rule drops and counts them), and
        delivery stops once ``limit`` such steps arrived, leaving the rest queued.
        ``check``: then raises :class:`NoSimulatorData` after ``wait_s`` without data and lets the launcher restart
        simulators that exited; after :meth:`interrupt`, raises :class:`CollectionInterrupted` once no simulator
        acted for ``_INTERRUPT_GRACE_S``."""
        steps = arrived = 0
        timeout: float | None = block_s
        while limit is None or steps < limit:
            try:
                fragment, meta, episodes = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
            except queue.Empty:
                break
            timeout = None
            for learner in self.learners.values():
                learner.receive(fragment, meta)
            self.stats.add(meta["worker_id"], meta["sequence"], episodes)
            self.reported[meta["worker_id"]] = meta["sequence"] + 1
            arrived += 1
            acted = meta["policy_versions"]
            if fresh is None or all(acted.get(pid, v) >= v for pid, v in fresh.items()):
                steps += meta["env_steps"]
        now = self._clock()
        if arrived:
            self._last_data, self._errors_at_data = now, dict(getattr(self.server, "errors", {}))
        if not check:
            return steps
        acted = self._acted(now)  # looked at on every delivery, so that a signal's grace runs from the last act
        if self._interrupted and not steps and now - acted > _INTERRUPT_GRACE_S:
            self._interrupted = False  # nobody acts: simulators away, restarting, or gone for good
            raise CollectionInterrupted("external collection interrupted")
        if not steps and self.wait_s and now - self._last_data > self.wait_s:
            why = self.server.refusals(self._errors_at_data) or ("is one running and pointed at this address, with "
                                                                 "the run's token and tree?")
            raise NoSimulatorData(f"no data from any external simulator for {self.wait_s:g} s "
                                  f"({len(self.server.connected)} connected to {self.server.url}): {why}. "
                                  f"--external.wait-s sets this limit (0: wait for good)")
        if self.launcher is not None:
            self.launcher.check(self.server.connected, self.server.welcomed)
        return steps

    def _acted(self, now: float) -> float:
        """When a simulator last asked for an action, uploaded a step or completed a fragment: a slow simulator
        (a robot at 20 Hz takes seconds per fragment) is acting, not away."""
        seen = self.server.counters["requests"] + self.server.counters["uploaded_steps"]
        if seen != self._activity:
            self._activity, self._last_activity = seen, now
        return max(self._last_activity, self._last_data)

    def collect(self, target_steps: int, weights: Weights, fresh_steps: Callable[[], int] | None = None) -> list[dict]:
        """Loads ``weights`` into the service, then delivers fragments until ``target_steps`` env steps acted by
        those weights alone arrived, and no more. Simulators do not wait while the learners train: what they did
        meanwhile was acted by older weights, is delivered first, and the learners' staleness rule (0 in
        synchronous mode, :func:`orchestration.builder.build_learner`) drops and counts it as stale."""
        self.broadcast(weights)
        self._last_data = self._clock()
        fresh = {pid: version for pid, (version, _) in weights.items() if pid in self.learners}
        got = 0
        while got < target_steps:
            got += self._deliver(0.1, fresh=fresh, limit=target_steps - got)
        return self.monitors()

    def start(self, weights: Weights) -> None:
        self.broadcast(weights)
        self._last_data = self._clock()

    def pump(self, weights: Weights | None = None, hungry: bool = False) -> None:
        """Delivers what the simulators produced (waits a moment when nothing is queued)."""
        self._deliver(_PUMP_WAIT_S)

    def trained(self, fragment_ids, learner: str = "") -> None:
        """Nothing to do: simulators run at their own pace."""

    def broadcast(self, weights: Weights, wait: bool = False, force: bool = False) -> None:
        """New weights for the service, loaded before its next batch (``wait`` changes nothing here: there is one
        copy, and it is swapped between batches; ``force``: even a version the service has, as restored)."""
        for pid, (version, w) in weights.items():
            if pid in self.service.versions and (force or version != self.service.versions[pid]):
                if not isinstance(w, TensorDictBase):  # a Ray learner's object-store ref: its own weights()
                    version, w = self.learners[pid].weights()
                self.service.set_weights(pid, version, w, force)

    # -- statistics, state -------------------------------------------------------------------------------------
    def episodes(self) -> dict[str, Any]:
        return self.stats.drain()

    def monitors(self) -> list[dict]:
        """One report: the server's, the recording's and the launcher's counters as ``env/external_*``."""
        counters = {f"external_{k}": v for k, v in {**self.server.counters, **self.lanes.counters,
                                                    **(self.launcher.counters if self.launcher else {})}.items()}
        counters["external_simulators_connected"] = len(self.server.connected)
        inference = self.service.stats()
        counters["external_inference_batches"] = inference["batches"]
        counters["external_inference_mean_requests"] = round(inference["mean_requests"], 2)
        return [{"worker_id": "external", "produced": sum(self.reported.values()), "push_failures": 0,
                 "monitor": {}, "env_counters": counters}]

    def actor_weights(self, policy_id: str) -> list[TensorDictBase]:
        return [self.service.weights(policy_id)]

    def state(self) -> list[dict]:
        return []

    def load_state_(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Nothing to restore: episodes in flight are not checkpointed (module docstring)."""

    def interrupt(self) -> None:
        """The collection under way (or the next) raises :class:`CollectionInterrupted` once no simulator acted
        (asked for an action, uploaded a step) for ``_INTERRUPT_GRACE_S``; while simulators act, however slowly, it
        completes and is trained on (this fleet keeps no state across a resume: what an abandoned collection received
        is not trained on, so only a stalled one is abandoned). Safe from a signal handler: it sets a flag."""
        self._interrupted = True

    def stop(self) -> None:
        """Stops the simulators and the server (open episodes end truncated), then delivers what they left."""
        self.server.ending()  # the simulators' ends are the run's, not failures to tell
        if self.launcher is not None:
            self.launcher.close()
        self.server.close()
        self._deliver(0, check=False)  # what they left; no waiting, no restarts any more

    def close(self) -> None:
        self.stop()
        self.service.close()


def _given_tree(path: str):
    """The tree of ``external.tree``, or a ValueError naming the flag, the file and what is wrong with it."""
    from core.specs import from_json

    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"--external.tree {path!r}: cannot read it ({error.strerror or error})") from None
    try:
        return from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        what = f"missing key {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
        raise ValueError(f"--external.tree {path!r} is not a tree document ({what}); docs/external-protocol.md "
                         f"shows the format") from None


def build_external(config: TrainConfig, *, log=None):
    """The server, the tree, the policies, the learners (local, or Ray learner actors with ``backend="ray"``),
    the inference service and the fleet of an ``--env external`` run. Returns ``(fleet, learners, tree,
    teardown)``."""
    from orchestration.learner import FixedLearner

    ec, log = config.external, sys.stderr if log is None else log  # resolved now: a default binds at import
    run_dir = Path(config.run_dir) if config.run_dir else None
    tree_file = run_dir / "tree.json" if run_dir else None  # the run's tree, written once known
    # a resumed run keeps its tree: a simulator with another one is refused (spec_mismatch), not adopted
    given = _given_tree(ec.tree or str(tree_file)) if ec.tree or tree_file and tree_file.is_file() else None
    token_file = run_dir / "external_token" if run_dir else None
    if not ec.token and token_file is not None and token_file.is_file():  # a resumed run: simulators keep theirs
        ec = dataclasses.replace(ec, token=token_file.read_text().strip())
    server = ExternalServer(ec, given, log=log).start()
    launcher = service = teardown = discard = None
    try:
        patience = "" if given is not None or ec.command else (  # the run needs the first one's tree
            f"; the first must connect within {ec.start_timeout_s:g} s (--external.start-timeout-s)")
        if token_file is not None:  # whole before the line below says so: a script may read it then
            token_file.parent.mkdir(parents=True, exist_ok=True)
            partial = token_file.with_name(f".{token_file.name}.{os.getpid()}")
            partial.touch(mode=0o600)
            partial.write_text(server.token)
            os.replace(partial, token_file)
        print(f"shoal: waiting for external environments at {server.url} (token {server.token}){patience}", file=log)
        if ec.command:
            launcher = SimulatorLauncher(ec.command, ec.instances, host=ec.host, port=server.port, token=server.token,
                                         seed=config.seed, start_timeout_s=ec.start_timeout_s,
                                         max_restarts=ec.max_restarts, restart_backoff_s=ec.restart_backoff_s,
                                         log_dir=Path(config.run_dir) / "simulators" if config.run_dir else None,
                                         log=log, refusal_of=server.refusal_of)
            launcher.start()
        # launched simulators get a second start_timeout_s: one that failed to connect is restarted once by then
        patience = ec.start_timeout_s * (2 if launcher is not None else 1)
        deadline = time.monotonic() + patience
        while not server.tree_ready.wait(0.1):
            if launcher is not None:
                launcher.check(server.connected, server.welcomed)
            if time.monotonic() > deadline:
                todo = (f"{launcher.summary()}. Check --external.command, or wait longer: with a launcher the wait "
                        f"is twice --external.start-timeout-s ({ec.start_timeout_s:g} s), so that a simulator that "
                        f"failed to connect is restarted once" if launcher is not None else "start simulators "
                        "(--external.command launches them), give --external.tree, or wait longer "
                        "(--external.start-timeout-s)")
                refused = f" ({server.refusals()})" if server.refusals() else ""
                raise TimeoutError(f"no simulator connected to {server.url} within {patience:g} s{refused}, so "
                                   f"the environment's tree is unknown: {todo}")
        tree = server.tree
        if tree_file is not None and not tree_file.is_file():
            tree_file.parent.mkdir(parents=True, exist_ok=True)
            tree_file.write_text(to_json(tree))
        assignment = assignment_for(config, tree)
        policies, fixed = build_policies(config, tree, assignment)
        if config.backend == "ray":
            from orchestration.ray_session import build_ray_learners, discard_learners

            ray_learners, _, _, teardown = build_ray_learners(config, tree, policies, fixed)  # built, or nothing
            discard = lambda: discard_learners(ray_learners, teardown)  # noqa: E731 - on a later error
            learners = {**ray_learners, **{pid: FixedLearner(policies[pid]) for pid in fixed}}
        else:
            learners = build_learners(config, assignment, {pid: copy.deepcopy(p) for pid, p in policies.items()},
                                      fixed)
        service = InferenceService(policies, InferenceConfig(max_batch_rows=ec.inference_batch_rows,
                                                             max_wait_s=ec.inference_wait_s, device=config.device,
                                                             seed=config.seed)).start()
        holder: list[ExternalFleet] = []
        lanes = Lanes(TreeCodec(tree), assignment, config.rollout.fragment_length,
                      lambda *item: holder[0].enqueue(*item))
        fleet = ExternalFleet(server, service, lanes, {pid: lrn for pid, lrn in learners.items() if lrn.learns},
                              launcher=launcher, wait_s=ec.wait_s)
        holder.append(fleet)
        server.attach(service, lanes, dataclasses.asdict(config.policy))
        return fleet, learners, tree, teardown
    except BaseException:
        if launcher is not None:
            launcher.close()
        server.close()
        if service is not None:
            service.close()
        if discard is not None:  # Ray learners that started: their actors and the registry go too
            discard()
        raise


__all__ = ["ExternalFleet", "build_external"]
