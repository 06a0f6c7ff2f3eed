"""The composition root of a Ray run: wires the Ray actors (``ray.init`` itself is in :mod:`orchestration.ray_session`).

:func:`build_ray_trainer` joins ``config.address`` (else ``RAY_ADDRESS``) or starts a local Ray instance
with an explicit CPU count, seeds the initial weights exactly as the local backend does, and builds:
one :class:`orchestration.ray_learner.LearnerServer` actor per policy (GPUs when the cluster has them;
learners of different policies train in parallel), the :class:`orchestration.ray_stats.EpisodeStatistics`
actor, and a :class:`orchestration.ray_fleet.RayFleet` of rollout workers. The :class:`RayTrainer` it
returns has the local trainer's surface (``train()``, ``iteration``, ``env_steps``, ``evaluate()``,
``learners``, ``actors``, ``close()``), so the CLI, the metrics log and checkpoints work unchanged.

Accounting (every fragment a worker produced is exactly one of these, per learner)::

    fragments_produced == fragments_accepted + fragments_stale + fragments_lost + fragments_in_flight

``in_flight`` (built or sent by a live worker, not yet taken by the learner) is 0 after :meth:`close`
and after every synchronous iteration; ``lost`` counts the fragments of dead workers that never reached
the learner, including those still in the dead worker's queue when it last reported, and what a dead
learner had received after its last checkpoint.

A dead learner (its process crashed, or its node went away) is restarted by Ray (``max_learner_restarts``)
and resumes from its last checkpoint: the driver snapshots every learner every ``learner_checkpoint_every``
iterations and whenever a checkpoint is written, keeps the snapshot in the object store and registers it
with a :class:`~orchestration.ray_learner_state.LearnerCheckpoints` actor (see :mod:`orchestration.ray_learner`).
The driver notices the death at its next call to that learner, waits for the new incarnation, takes its
weights and goes on; ``learners_restarted`` counts restarts.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, Mapping

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tensordict import TensorDict

from core.policies import GroupPolicy
from core.specs import to_json
from orchestration.actor import Actor
from orchestration.assignment import assign
from orchestration.config import RayConfig, TrainConfig
from orchestration.envs import make_run_env
from orchestration.trainer import build_policies, episode_metrics
from orchestration.learner import FixedLearner, PPOLearner
from orchestration.ray_fleet import RayFleet, Weights
from orchestration.ray_session import check_resources, cpus_needed, init_ray, kill_actor
from orchestration.ray_learner import LearnerMirrors, RemoteLearner, RemoteLearnerCheckpoints, learner_options
from orchestration.ray_stats import RemoteEpisodeStatistics, fragment_accounting, merge_monitors
from orchestration.wire import from_wire, to_wire

_log = logging.getLogger(__name__)


class RayTrainer:
    """One ``train()`` call = one iteration, over Ray actors (the local :class:`Trainer`'s surface).

    Synchronous mode: the fleet collects ``train_batch_size`` env steps with the current weights, every
    learner trains on them (in parallel), the new weights refs go to the workers with the next collect.
    Asynchronous mode: workers stream; the iteration ends when every learner has trained once on a ready
    batch; each new version is broadcast as soon as it is published.
    """

    resume_exact = False
    """A resumed Ray run restarts its workers' envs (learners resume exactly; sampling does not)."""

    def __init__(self, config: TrainConfig, ray_config: RayConfig, learners: Mapping[str, Any], fleet: RayFleet,
                 stats, eval_actor: Actor | None, tree, weights: Weights, owns_ray: bool,
                 fixed: Mapping[str, GroupPolicy], checkpoints=None) -> None:
        self.config, self.ray_config, self.tree = config, ray_config, tree
        self.handles, self.fleet, self.stats, self.eval_actor = dict(learners), fleet, stats, eval_actor
        self.weights: dict[str, tuple[int, list]] = dict(weights)
        self.iteration = 0
        self.env_steps = 0
        self._produced = 0
        self.history: dict[str, deque[float]] = {}
        """Last 100 finished episodes: ``"return"``, ``"length"``, ``"return/<policy>"`` (as the local trainer)."""
        self.last_episodes: dict[str, list[float]] = {}
        """The episodes that finished during the last iteration, same keys."""
        self.fixed = dict(fixed)
        self._owns_ray, self._started, self._closed = owns_ray, False, False
        self._mirrors = LearnerMirrors(config, tree, self.handles, fixed)
        self._final: dict[str, float] | None = None
        self.checkpoints = checkpoints
        """The :class:`~orchestration.ray_learner_state.LearnerCheckpoints` actor restarted learners resume from."""
        self.learners_recovered = 0
        """Learner deaths this driver noticed (and waited out); ``learners_restarted`` counts them all."""

    # -- one iteration -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """One iteration; returns its metrics (plain floats)."""
        if self._closed:
            raise RuntimeError("this trainer was closed")
        self._push_restored_mirrors()
        cfg = self.config
        progress = self.iteration / max(cfg.iterations, 1)
        lr = cfg.lr * max(0.0, 1.0 - progress) if cfg.anneal_lr else None
        steps_before = self.env_steps
        start = time.perf_counter()
        if self.ray_config.mode == "sync":
            metrics, monitors, t_collect, t_learn = self._train_sync(progress, lr)
        else:
            metrics, monitors, t_collect, t_learn = self._train_async(progress, lr)
        self.iteration += 1
        metrics.update(self._episodes())
        metrics.update(self.accounting())
        metrics.update(merge_monitors(monitors))
        produced = int(metrics["fragments_produced"])  # env steps: every fragment the fleet produced, counted once
        self.env_steps += (produced - self._produced) * self.fleet.fragment_steps
        self._produced = produced
        wall = time.perf_counter() - start
        metrics.update(iteration=self.iteration, env_steps=self.env_steps, time_collect=t_collect, time_learn=t_learn,
                       time_iteration=wall, env_steps_per_s=(self.env_steps - steps_before) / max(wall, 1e-9))
        if self.eval_actor is not None and cfg.eval_every and self.iteration % cfg.eval_every == 0:
            metrics.update(self.evaluate())
        every = self.ray_config.learner_checkpoint_every
        if every and self.iteration % every == 0:
            self.snapshot_learners()
        return metrics

    def _prefixed(self, pid: str, values: Mapping[str, float]) -> dict[str, float]:
        several = len(self.handles) + len(self.fixed) > 1  # named as the local trainer names them
        return {f"{pid}/{k}" if several else k: v for k, v in values.items()}

    def _train_sync(self, progress: float, lr: float | None):
        start = time.perf_counter()
        recovered = self.learners_recovered
        reports = self.fleet.collect(self.config.steps_per_iteration, self.weights, self._new_steps)
        if self.learners_recovered != recovered or any(r.get("push_failures") for r in reports):
            self._settle()  # pushes that reached no learner (one was down): lost, so nothing stays in flight
        collected = time.perf_counter()
        refs = {pid: h.train.remote(progress, lr, True) for pid, h in self.handles.items()}
        metrics: dict[str, float] = {}
        for pid, ref in refs.items():
            result = self._get(pid, ref)  # None: not ready, or the learner died (its batch is lost)
            if result is not None:
                self.weights[pid] = (result["version"], result["weights"])
                metrics.update(self._prefixed(pid, result["metrics"]))
        return metrics, [r["monitor"] for r in reports], collected - start, time.perf_counter() - collected

    def _new_steps(self) -> int:
        return min(self._call(pid, "new_steps") for pid in self.handles)

    # -- learner faults ----------------------------------------------------------------------------------
    def _get(self, pid: str, ref):
        """``ray.get(ref)`` of a call to learner ``pid``; None when the learner died (then waited out)."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self._recover(pid, err)
            return None

    def _call(self, pid: str, method: str, *args):
        """Calls a learner method; if the learner died, waits for its restart and calls the new incarnation."""
        result = self._get(pid, getattr(self.handles[pid], method).remote(*args))
        return result if result is not None else ray.get(getattr(self.handles[pid], method).remote(*args))

    def _recover(self, pid: str, err: BaseException) -> None:
        """Waits until Ray restarted learner ``pid`` (it resumed from its checkpoint); takes its weights."""
        handle = self.handles[pid]
        try:  # calls to a restarting actor fail; this one is retried until the actor is back
            ray.get(handle.ping.options(max_task_retries=-1).remote(), timeout=self.ray_config.iteration_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as again:
            raise RuntimeError(f"learner {pid!r} died and was not restarted (RayConfig.max_learner_restarts="
                               f"{self.ray_config.max_learner_restarts})") from again
        self.learners_recovered += 1
        _log.warning("learner %r died (%s); it resumed from its last checkpoint", pid, type(err).__name__)
        self.weights[pid] = ray.get(handle.published.remote())
        if self._started:
            self.fleet.broadcast({pid: self.weights[pid]})

    def _settle(self) -> None:
        """Counts as lost, at every learner, the fragments the workers delivered or failed to deliver that it
        never got (call when every worker has flushed: after a synchronous collect, or after stopping)."""
        produced = dict(self.fleet.reported)
        for pid in self.handles:
            self._call(pid, "settle", produced)

    def snapshot_learners(self) -> dict[str, dict]:
        """Takes every learner's checkpoint (state and ledger) and registers it for restarts; returns them.

        The driver ``get``s each one and ``put``s its own copy: it lives on the driver's node and is owned by
        the driver, so it outlives the learner and the learner's node.
        """
        out, saves = {}, []
        for pid in self.handles:
            checkpoint = self._call(pid, "checkpoint")
            saves.append(self.checkpoints.save.remote(pid, [ray.put(checkpoint)], checkpoint["learner"]["version"]))
            out[pid] = checkpoint
        ray.get(saves)  # registered before anything else happens: a learner that dies next resumes from these
        return out

    def _train_async(self, progress: float, lr: float | None):
        rc = self.ray_config
        if not self._started:
            self.fleet.start(self.weights)
            self._started = True
        start = last_progress = time.perf_counter()
        metrics: dict[str, float] = {}
        pending = {h.train.remote(progress, lr, False): pid for pid, h in self.handles.items()}
        t_learn = 0.0
        while pending:
            self.fleet.check(self.weights)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in done:
                pid = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as err:  # it died: wait for its restart, ask again
                    self._recover(pid, err)
                    pending[self.handles[pid].train.remote(progress, lr, False)] = pid
                    continue
                if result is None:  # not ready: ask again shortly (the learner serves pushes meanwhile)
                    if time.perf_counter() - last_progress > rc.iteration_timeout_s:
                        raise TimeoutError(f"learner {pid!r} got no trainable batch for {rc.iteration_timeout_s} s")
                    time.sleep(rc.poll_interval_s)
                    pending[self.handles[pid].train.remote(progress, lr, False)] = pid
                    continue
                last_progress = time.perf_counter()
                self.weights[pid] = (result["version"], result["weights"])
                self.fleet.broadcast({pid: self.weights[pid]})
                metrics.update(self._prefixed(pid, result["metrics"]))
                t_learn += result["time_learn"]
        wall = time.perf_counter() - start
        return metrics, [r["monitor"] for r in self.fleet.monitors()], wall - t_learn, t_learn

    # -- statistics and accounting -----------------------------------------------------------------------
    def _episodes(self) -> dict[str, float]:
        """The local trainer's episode metrics, from the episodes the statistics actor got since last time."""
        try:
            drained = ray.get(self.stats.drain.remote())
        except ray.exceptions.RayActorError:  # its node died: it restarts empty, the episodes it held are gone
            drained = {"episodes": {}, "summary": {}}
        self.last_episodes = {k: list(v) for k, v in drained["episodes"].items()}
        for key, values in self.last_episodes.items():
            self.history.setdefault(key, deque(maxlen=100)).extend(values)
        return {"episodes": len(self.last_episodes.get("length", [])), **drained["summary"],
                **episode_metrics(self.history)}

    def learner_reports(self) -> dict[str, dict]:
        """Each learner's ledger and counters (:meth:`LearnerServer.report`)."""
        refs = {pid: h.report.remote() for pid, h in self.handles.items()}
        return {pid: r if (r := self._get(pid, ref)) is not None else self._call(pid, "report")
                for pid, ref in refs.items()}

    def accounting(self, reports: Mapping[str, dict] | None = None) -> dict[str, float]:
        """Fragment accounting (module docstring), restarts and weight serializations, as metrics."""
        if self._final is not None:
            return dict(self._final)
        reports = reports if reports is not None else self.learner_reports()
        produced, per_learner = fragment_accounting(reports, self.fleet.reported, self.fleet.dead)
        out: dict[str, float] = {"fragments_produced": produced, "workers_restarted": self.fleet.restarts,
                                 "learners_restarted": sum(r.get("restarts", 0) for r in reports.values())}
        for pid, values in per_learner.items():
            out.update(self._prefixed(pid, values))
        return out

    # -- evaluation, checkpoints, shutdown ---------------------------------------------------------------
    def evaluate(self, episodes: int | None = None) -> dict[str, float]:
        """Mean returns of a deterministic actor in this process with the newest published weights:
        ``eval_return_mean`` and, with several policies, ``eval_return_mean/<policy>``."""
        actor = self.eval_actor
        if actor is None:
            raise ValueError("this trainer has no evaluation actor (config.eval_every == 0)")
        for pid, (version, refs) in self.weights.items():
            actor.set_weights(pid, version, from_wire(ray.get(refs[0])))
        out = {}
        for key, values in actor.run_episodes(episodes or self.config.eval_episodes).items():
            if key.startswith("return/") and len(self.handles) + len(self.fixed) < 2:
                continue
            out[key.replace("return", "eval_return_mean", 1)] = sum(values) / max(len(values), 1)
        return out

    @property
    def learners(self) -> dict[str, PPOLearner | FixedLearner]:
        """Local mirrors of the learners (weights, optimizer, generator, version, counters), fetched now.

        For :func:`orchestration.run_state.trainer_state` / ``restore_trainer_``: a mirror changed by a
        restore is pushed back to its remote learner at the start of the next :meth:`train`. Fetching them
        (writing a checkpoint) also makes them the checkpoint a dead learner resumes from.
        """
        if self._closed:
            return self._mirrors.fetch(refresh=False)
        snapshot = self.snapshot_learners()
        return self._mirrors.fetch(states={pid: c["learner"] for pid, c in snapshot.items()})

    def _push_restored_mirrors(self) -> None:
        changed = self._mirrors.push_changed()
        for pid in changed:
            self.weights[pid] = ray.get(self.handles[pid].published.remote())
        if changed:
            self.snapshot_learners()  # a crash from now on resumes the restored state

    @property
    def actors(self) -> list:
        """Rollout workers' states are not checkpointed: a resumed Ray run restarts its envs."""
        return []

    def close(self) -> None:
        """Stops streaming, settles the accounting, snapshots the learners, releases every actor."""
        if self._closed:
            return
        if self._started:
            self.fleet.stop()
        self._settle()  # every worker flushed: what a learner never got is lost (in flight only while running)
        self._final = self.accounting()
        self.learners  # noqa: B018 -- snapshot the mirrors while the learners are alive (checkpoint after close)
        self._closed = True
        self.fleet.shutdown()
        for handle in [*self.handles.values(), self.stats, self.checkpoints]:
            kill_actor(handle)
        if self._owns_ray:
            ray.shutdown()


def initial_policies(config: TrainConfig, tree) -> tuple[dict, dict[str, GroupPolicy], set[str]]:
    """``(assignment, policy id -> module, fixed policy ids)`` exactly as the local backend builds them.

    Call right after ``torch.manual_seed(config.seed)``: the same generator draws give the same weights.
    """
    assignment = assign(tree, dict(config.policy_mapping))
    policies, fixed = build_policies(config, tree, assignment)
    return assignment, policies, fixed


def _add_data_parallel_ranks(config: TrainConfig, ray_config: RayConfig, learners: Mapping[str, Any],
                             policies: Mapping[str, GroupPolicy], assignment, options: Mapping[str, Any]) -> None:
    """Gives every learner ``learners_per_policy - 1`` peer ranks and joins them in one torch.distributed group."""
    from orchestration.assignment import groups_of
    from orchestration.ray_data_parallel import RemoteRank

    world = ray_config.learners_per_policy
    for pid, server in learners.items():
        peers = [RemoteRank.options(**options).remote(
            policies[pid], groups_of(assignment, pid), ppo=config.ppo, lr=config.lr,
            batch_steps=config.steps_per_iteration // world, seed=config.seed,
            device="cuda" if options.get("num_gpus") else "cpu") for _ in range(world - 1)]
        address, port = ray.get(server.rendezvous.remote())
        ray.get([server.join_data_parallel.remote(peers, address, port)]
                + [peer.join.remote(rank, world, address, port) for rank, peer in enumerate(peers, 1)])


def build_ray_trainer(config: TrainConfig, ray_config: RayConfig | None = None) -> RayTrainer:
    """The composition root of a Ray run: Ray, learners, statistics, fleet and evaluation actor.

    Args:
        config: the run (``config.address`` to join a cluster).
        ray_config: modes, placement and bounds of the Ray backend (default: ``config.ray``).
    """
    ray_config = ray_config or config.ray
    rc = config.rollout
    torch.manual_seed(config.seed)  # initial weights: the local backend's generator use, at the entry point
    probe = make_run_env(config, 1)
    tree = probe.tree
    probe.close()
    assignment, policies, fixed = initial_policies(config, tree)
    trained = [pid for pid in policies if pid not in fixed]
    owns_ray = init_ray(config, ray_config, cpus_needed(config, ray_config, len(trained)))
    joined = bool(config.address or os.environ.get("RAY_ADDRESS"))
    check_resources(config, ray_config, len(trained), strict=owns_ray and not joined)
    options = learner_options(ray_config.learner_num_cpus, ray_config.learner_num_gpus, len(trained),
                              dict(ray_config.learner_resources))
    tree_json = to_json(tree)
    wire = {pid: to_wire(TensorDict.from_module(p).detach()) for pid, p in policies.items()}
    # The checkpoint registry stays near the driver (it reserves nothing, so it never competes with the
    # learners for pinned resources); statistics live beside the learners when they are pinned.
    near_driver = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                         soft=True)}
    placement = {"resources": dict(ray_config.learner_resources)} if ray_config.learner_resources else near_driver
    checkpoints = RemoteLearnerCheckpoints.options(max_restarts=-1, **near_driver).remote()
    # A data-parallel rank 0 is not restarted: its peers' process group would not survive it.
    restarts = ray_config.max_learner_restarts if ray_config.learners_per_policy == 1 else 0
    learners = {pid: RemoteLearner.options(max_restarts=restarts, **options).remote(
        pid, config, tree_json, wire[pid], max_staleness=ray_config.max_staleness, reuse_limit=ray_config.reuse_limit,
        resolve_timeout_s=ray_config.resolve_timeout_s, num_threads=ray_config.learner_threads,
        checkpoints=checkpoints) for pid in trained}
    if ray_config.learners_per_policy > 1:
        _add_data_parallel_ranks(config, ray_config, learners, policies, assignment, options)
    weights = dict(zip(trained, ray.get([learners[pid].published.remote() for pid in trained])))
    weights.update({pid: (0, [ray.put(wire[pid])]) for pid in fixed})  # frozen: one put for the whole run
    stats = RemoteEpisodeStatistics.options(max_restarts=-1, **placement).remote()
    fleet = RayFleet(config, ray_config, learners, stats, weights)
    eval_actor = None
    if config.eval_every:
        eval_env = make_run_env(config, min(rc.num_envs, config.eval_episodes))
        eval_actor = Actor(eval_env, policies, assignment, seed=config.seed + 10**6, deterministic=trained,
                           record=False)
    return RayTrainer(config, ray_config, learners, fleet, stats, eval_actor, tree, weights, owns_ray,
                      {pid: policies[pid] for pid in fixed}, checkpoints)


__all__ = ["RayConfig", "RayTrainer", "build_ray_trainer", "init_ray", "initial_policies"]
