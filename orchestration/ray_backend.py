"""The composition root of a Ray run: the only place that calls ``ray.init`` and wires the Ray actors.

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
the learner, including those still in the dead worker's queue when it last reported.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tensordict import TensorDict

from core.policies import GroupPolicy, make_policies
from core.specs import to_json
from orchestration.actor import Actor
from orchestration.assignment import assign, groups_of
from orchestration.config import TrainConfig
from orchestration.envs import make_env, parse_kwargs
from orchestration.learner import PPOLearner
from orchestration.ray_fleet import RayFleet, Weights
from orchestration.ray_learner import RemoteLearner, learner_options, learner_state, load_learner_state_, policy_module
from orchestration.ray_stats import RemoteEpisodeStatistics, merge_monitors
from orchestration.wire import from_wire, to_wire


@dataclass(frozen=True, kw_only=True, slots=True)
class RayConfig:
    """How the Ray backend places and runs the fleet and the learners (no Ray import needed to build one)."""

    mode: Literal["sync", "async"] = "sync"
    """``sync``: collect ``train_batch_size`` with the current weights, train, broadcast (seed 000).
    ``async``: workers stream; each learner trains whenever a batch is ready (seed 004)."""
    max_staleness: int = 1
    """Fragments whose policy version lags the learner's by more than this are dropped and counted."""
    reuse_limit: int = 1
    """Times a fragment may be trained on (async mode tops up a batch with reusable data)."""
    queue_size: int = 2
    """Fragments buffered between a worker's sampling loop and its sender thread."""
    max_in_flight: int = 2
    """Pushes per learner a sender thread may have unacknowledged before it waits."""
    num_cpus: float | None = None
    """CPUs of a local Ray instance this backend starts (None: ``os.cpu_count()``)."""
    worker_num_cpus: float = 1.0
    """Ray CPUs reserved per rollout worker (fractions allowed)."""
    learner_num_cpus: float = 1.0
    """Ray CPUs reserved per learner."""
    learner_num_gpus: float | Literal["auto"] = "auto"
    """GPUs per learner; ``auto``: share the cluster's GPUs among learners when it has any, else 0."""
    learner_resources: tuple[tuple[str, float], ...] = ()
    """Custom Ray resources per learner, e.g. ``(("learner_node", 1),)`` to pin learners to a node."""
    worker_strategy: Literal["DEFAULT", "SPREAD"] = "DEFAULT"
    """Ray scheduling strategy of rollout workers (``SPREAD``: across nodes)."""
    max_worker_restarts: int = 100
    """Re-creations of dead rollout workers allowed over the run before it fails."""
    resolve_timeout_s: float = 30.0
    """A learner gives up fetching a pushed fragment after this long (counted lost)."""
    worker_threads: int = 1
    """torch threads per rollout worker."""
    learner_threads: int = 1
    """torch threads per learner."""
    poll_interval_s: float = 0.002
    """Async mode: pause between readiness polls of the learners."""
    iteration_timeout_s: float = 600.0
    """Async mode: fail when no learner could train for this long."""

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"RayConfig.mode must be 'sync' or 'async', got {self.mode!r}")
        for name in ("max_staleness", "max_worker_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"RayConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("reuse_limit", "queue_size", "max_in_flight", "worker_threads", "learner_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"RayConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.worker_num_cpus < 0 or self.learner_num_cpus < 0 or (self.num_cpus is not None and self.num_cpus <= 0):
            raise ValueError("RayConfig CPU counts must be >= 0 (num_cpus > 0)")


def init_ray(config: TrainConfig, ray_config: RayConfig) -> bool:
    """Connects this process to Ray; returns True when this call started or joined it (and owns shutdown).

    Order: an already initialised Ray (a test session, a Tune trial) is reused; else ``config.address``,
    else ``RAY_ADDRESS`` is joined; else a local instance starts with ``ray_config.num_cpus`` CPUs.
    """
    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, configure_logging=False)
    else:
        ray.init(num_cpus=ray_config.num_cpus or os.cpu_count(), include_dashboard=False, configure_logging=False)
    return True


def _check_resources(config: TrainConfig, ray_config: RayConfig, num_learners: int, strict: bool) -> None:
    need = config.rollout.num_workers * ray_config.worker_num_cpus + num_learners * ray_config.learner_num_cpus
    have = ray.cluster_resources().get("CPU", 0.0)
    if need > have + 1e-9:
        message = (f"the Ray backend reserves {need:g} CPUs ({config.rollout.num_workers} workers x "
                   f"{ray_config.worker_num_cpus:g} + {num_learners} learners x {ray_config.learner_num_cpus:g}) "
                   f"but the cluster has {have:g}: lower RayConfig.worker_num_cpus / learner_num_cpus")
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)


class RayTrainer:
    """One ``train()`` call = one iteration, over Ray actors (the local :class:`Trainer`'s surface).

    Synchronous mode: the fleet collects ``train_batch_size`` env steps with the current weights, every
    learner trains on them (in parallel), the new weights refs go to the workers with the next collect.
    Asynchronous mode: workers stream; the iteration ends when every learner has trained once on a ready
    batch; each new version is broadcast as soon as it is published.
    """

    def __init__(self, config: TrainConfig, ray_config: RayConfig, learners: Mapping[str, Any], fleet: RayFleet,
                 stats, eval_actor: Actor | None, tree, weights: Weights, owns_ray: bool) -> None:
        self.config, self.ray_config, self.tree = config, ray_config, tree
        self.handles, self.fleet, self.stats, self.eval_actor = dict(learners), fleet, stats, eval_actor
        self.weights: dict[str, tuple[int, list]] = dict(weights)
        self.iteration = 0
        self.env_steps = 0
        self.returns: deque[float] = deque(maxlen=100)
        self.lengths: deque[float] = deque(maxlen=100)
        self._owns_ray, self._started, self._closed = owns_ray, False, False
        self._mirrors: dict[str, PPOLearner] = {}
        self._mirror_versions: dict[str, int] = {}
        self._final: dict[str, float] | None = None

    # -- one iteration -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """One iteration; returns its metrics (plain floats)."""
        if self._closed:
            raise RuntimeError("this trainer was closed")
        self._push_restored_mirrors()
        cfg = self.config
        progress = self.iteration / max(cfg.iterations, 1)
        lr = cfg.lr * (1.0 - progress) if cfg.anneal_lr else None
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
        self.env_steps = int(metrics["fragments_produced"]) * self.fleet.fragment_steps
        wall = time.perf_counter() - start
        metrics.update(iteration=self.iteration, env_steps=self.env_steps, time_collect=t_collect, time_learn=t_learn,
                       time_iteration=wall, env_steps_per_s=(self.env_steps - steps_before) / max(wall, 1e-9))
        if self.eval_actor is not None and cfg.eval_every and self.iteration % cfg.eval_every == 0:
            metrics["eval_return_mean"] = self.evaluate()
        return metrics

    def _prefixed(self, pid: str, values: Mapping[str, float]) -> dict[str, float]:
        return {f"{pid}/{k}" if len(self.handles) > 1 else k: v for k, v in values.items()}

    def _train_sync(self, progress: float, lr: float | None):
        start = time.perf_counter()
        reports = self.fleet.collect(self.config.steps_per_iteration, self.weights, self._new_steps)
        collected = time.perf_counter()
        results = ray.get([h.train.remote(progress, lr, True) for h in self.handles.values()])
        metrics: dict[str, float] = {}
        for pid, result in zip(self.handles, results):
            if result is not None:
                self.weights[pid] = (result["version"], result["weights"])
                metrics.update(self._prefixed(pid, result["metrics"]))
        return metrics, [r["monitor"] for r in reports], collected - start, time.perf_counter() - collected

    def _new_steps(self) -> int:
        return min(ray.get([h.new_steps.remote() for h in self.handles.values()]))

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
                result = ray.get(ref)
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
        drained = ray.get(self.stats.drain.remote())
        self.returns.extend(drained["returns"])
        self.lengths.extend(drained["lengths"])
        last10 = list(self.returns)[-10:]
        out = {k: v for k, v in drained["summary"].items() if "/" in k or k == "episodes_total"}
        out.update(episodes=len(drained["returns"]),
                   episode_return_mean=sum(self.returns) / len(self.returns) if self.returns else math.nan,
                   episode_return_mean_10=sum(last10) / len(last10) if last10 else math.nan,
                   episode_length_mean=sum(self.lengths) / len(self.lengths) if self.lengths else math.nan)
        return out

    def learner_reports(self) -> dict[str, dict]:
        """Each learner's ledger and counters (:meth:`LearnerServer.report`)."""
        return dict(zip(self.handles, ray.get([h.report.remote() for h in self.handles.values()])))

    def accounting(self, reports: Mapping[str, dict] | None = None) -> dict[str, float]:
        """Fragment accounting (module docstring), restarts and weight serializations, as metrics."""
        if self._final is not None:
            return dict(self._final)
        reports = reports if reports is not None else self.learner_reports()
        fleet = self.fleet
        heard: dict[int, int] = {}
        for report in reports.values():
            for wid, w in report["workers"].items():
                heard[int(wid)] = max(heard.get(int(wid), 0), w["max_seq"] + 1)
        produced = {w: max(heard.get(w, 0), fleet.reported.get(w, 0)) for w in set(heard) | set(fleet.reported)}
        out: dict[str, float] = {"fragments_produced": sum(produced.values()), "workers_restarted": fleet.restarts}
        for pid, report in reports.items():
            counts = {"accepted": 0, "stale": 0, "lost": 0, "in_flight": 0}
            for wid, made in produced.items():
                w = report["workers"].get(wid, {"accepted": 0, "stale": 0, "lost": 0})
                for state in ("accepted", "stale", "lost"):
                    counts[state] += w[state]
                unseen = made - (w["accepted"] + w["stale"] + w["lost"])
                counts["lost" if wid in fleet.dead else "in_flight"] += unseen
            values = {f"fragments_{k}": v for k, v in counts.items()}
            values.update(fragments_duplicate=report["counters"]["duplicates"],
                          fragments_max_uses=report["max_uses"], trained_max_lag=report["counters"]["max_trained_lag"],
                          weights_serializations=report["counters"]["serializations"], policy_version=report["version"])
            out.update(self._prefixed(pid, values))
        return out

    # -- evaluation, checkpoints, shutdown ---------------------------------------------------------------
    def evaluate(self, episodes: int | None = None) -> float:
        """Mean return of a deterministic actor in this process with the newest published weights."""
        actor = self.eval_actor
        if actor is None:
            raise ValueError("this trainer has no evaluation actor (config.eval_every == 0)")
        for pid, (version, refs) in self.weights.items():
            actor.set_weights(pid, version, from_wire(ray.get(refs[0])))
        returns = actor.run_episodes(episodes or self.config.eval_episodes)
        return sum(returns) / max(len(returns), 1)

    @property
    def learners(self) -> dict[str, PPOLearner]:
        """Local mirrors of the remote learners (weights, optimizer, generator, version, counters).

        For :func:`orchestration.run_state.trainer_state` / ``restore_trainer_``: a mirror changed by a
        restore is pushed back to its remote learner at the start of the next :meth:`train`.
        """
        if not self._mirrors:
            assignment = assign(self.tree, dict(self.config.policy_mapping))
            for pid in self.handles:
                self._mirrors[pid] = PPOLearner(policy_module(self.tree, self.config, assignment, pid),
                                                groups_of(assignment, pid), ppo=self.config.ppo, lr=self.config.lr,
                                                batch_steps=self.config.steps_per_iteration, seed=self.config.seed)
        if not self._closed:
            for pid, state in zip(self.handles, ray.get([h.state.remote() for h in self.handles.values()])):
                load_learner_state_(self._mirrors[pid], state)
                self._mirror_versions[pid] = self._mirrors[pid].version
        return dict(self._mirrors)

    def _push_restored_mirrors(self) -> None:
        for pid, mirror in self._mirrors.items():
            if mirror.version != self._mirror_versions.get(pid):
                ray.get(self.handles[pid].load_state.remote(learner_state(mirror)))
                self.weights[pid] = ray.get(self.handles[pid].published.remote())
                self._mirror_versions[pid] = mirror.version

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
        self._final = self.accounting()
        self.learners  # noqa: B018 -- snapshot the mirrors while the learners are alive (checkpoint after close)
        self._closed = True
        self.fleet.shutdown()
        for handle in [*self.handles.values(), self.stats]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        if self._owns_ray:
            ray.shutdown()


def initial_policies(config: TrainConfig, tree) -> tuple[dict, dict[str, GroupPolicy], set[str]]:
    """``(assignment, policy id -> module, fixed policy ids)`` exactly as the local backend builds them.

    Call right after ``torch.manual_seed(config.seed)``: the same generator draws give the same weights.
    """
    from orchestration.trainer import _policy_for, _uniform  # the local composition root's own rules

    assignment = assign(tree, dict(config.policy_mapping))
    policies = make_policies(tree, config.policy)
    out, fixed = {}, set()
    for pid in sorted({p for a in assignment.values() for p in a.policies}):
        policy = policies.get(pid) or _policy_for(pid, assignment, policies)
        if pid in config.fixed_policies or pid == "random":
            fixed.add(pid)
            policy = _uniform(policy) if pid == "random" else policy
        out[pid] = policy
    return assignment, out, fixed


def build_ray_trainer(config: TrainConfig, ray_config: RayConfig | None = None) -> RayTrainer:
    """The composition root of a Ray run: Ray, learners, statistics, fleet and evaluation actor.

    Args:
        config: the run (``config.address`` to join a cluster).
        ray_config: modes, placement and bounds of the Ray backend (defaults: synchronous PPO).
    """
    ray_config = ray_config or RayConfig()
    owns_ray = init_ray(config, ray_config)
    kwargs = parse_kwargs(config.env_kwargs)
    rc = config.rollout
    torch.manual_seed(config.seed)  # initial weights: the local backend's generator use, at the entry point
    probe = make_env(config.env, 1, check=rc.check, kwargs=kwargs)
    tree = probe.tree
    probe.close()
    assignment, policies, fixed = initial_policies(config, tree)
    trained = [pid for pid in policies if pid not in fixed]
    joined = bool(config.address or os.environ.get("RAY_ADDRESS"))
    _check_resources(config, ray_config, len(trained), strict=owns_ray and not joined)
    options = learner_options(ray_config.learner_num_cpus, ray_config.learner_num_gpus, len(trained),
                              dict(ray_config.learner_resources))
    tree_json = to_json(tree)
    wire = {pid: to_wire(TensorDict.from_module(p).detach()) for pid, p in policies.items()}
    learners = {pid: RemoteLearner.options(**options).remote(
        pid, config, tree_json, wire[pid], max_staleness=ray_config.max_staleness, reuse_limit=ray_config.reuse_limit,
        resolve_timeout_s=ray_config.resolve_timeout_s, num_threads=ray_config.learner_threads) for pid in trained}
    weights = dict(zip(trained, ray.get([learners[pid].published.remote() for pid in trained])))
    weights.update({pid: (0, [ray.put(wire[pid])]) for pid in fixed})  # frozen: one put for the whole run
    main = {g: a.main_policy for g, a in assignment.items()}
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    stats = RemoteEpisodeStatistics.options(scheduling_strategy=here).remote(main)  # lives as long as the driver
    fleet = RayFleet(config, ray_config, learners, stats, weights)
    eval_actor = None
    if config.eval_every:
        eval_env = make_env(config.env, min(rc.num_envs, config.eval_episodes), check=rc.check, kwargs=kwargs)
        eval_actor = Actor(eval_env, policies, assignment, seed=config.seed + 10**6, deterministic=True, record=False)
    return RayTrainer(config, ray_config, learners, fleet, stats, eval_actor, tree, weights, owns_ray)


__all__ = ["RayConfig", "RayTrainer", "build_ray_trainer", "init_ray", "initial_policies"]
