"""Trainer (seed 002): one training loop over any fleet and any learners, synchronous or asynchronous.

The Trainer interface. Usage loop (what ``shoal train`` does)::

    trainer = build_trainer(config)             # orchestration.builder: local or Ray fleet and learners
    while trainer.iteration < config.iterations:
        metrics = trainer.train()               # one iteration: plain floats
    trainer.close()

Synchronous mode (seed 000): the fleet delivers ``train_batch_size`` env steps acting with the current
weights, every learner trains once on all of it (learners train in parallel where they run apart), and the
new weights go to the fleet with the next collect. Asynchronous mode (seed 004): the fleet keeps producing;
the iteration ends when every learning policy has trained once on a ready batch; each new version is handed
to the fleet as soon as it is published, and actors load it at their next fragment boundary. What a learner
trains on is decided by its inbox (core's staleness and reuse rules), the same for every backend.

Environment collections (``config.collection``): before each iteration the trainer draws one member per actor
(:class:`orchestration.collection_driver.CollectionDriver`, part of :meth:`Trainer.state`), and after it reports
per-env episode metrics and updates the structure (curriculum, adversarial returns); evaluation runs on the
collection's evaluation envs only, per env id.

Team critics (``config.team_critic``, :mod:`orchestration.team_critic`): in synchronous mode, after the
collect, the critic hands its values of the batch to the member learners (they compute their advantages with
them), then trains beside them; its state is part of :meth:`Trainer.state`.

Trainers nest: a league (:mod:`orchestration.league`) drives a Trainer and swaps frozen opponents with
:meth:`Trainer.set_weights`, which reaches every actor before the next fragment it produces.

Accounting (every fragment the fleet produced is exactly one of these, per learner)::

    fragments_produced == fragments_accepted + fragments_stale + fragments_lost + fragments_in_flight
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from typing import Any, Callable, Mapping

from tensordict import TensorDictBase

from orchestration.collection_driver import CollectionDriver, evaluate_members
from orchestration.config import TrainConfig
from core.specs import groups
from orchestration.fleet import CollectionInterrupted
from orchestration.state_fit import load_learners_
from orchestration.statistics import (episode_metrics, fragment_accounting, merge_monitors, structure_metrics,
                                      worker_counters)
from orchestration.user_errors import StalledRun, known


class Trainer:
    """Runs iterations over a fleet and learners and keeps the run's counters.

    Args:
        config: the run (``config.mode``: sync or async).
        fleet: where fragments come from (:mod:`orchestration.fleet`).
        learners: policy id -> learner (:mod:`orchestration.learner` protocol; local or remote).
        evaluator: a deterministic actor on separate envs, or None.
        make_evaluator: builds one when :meth:`evaluate` is called without ``evaluator`` (its envs are made then).
        tree: the env's tree.
        on_close: called last by :meth:`close` (the builder's teardown, e.g. a Ray instance it started).
        team_critic: the team critic (a :class:`orchestration.team_critic.TeamCriticLearner` or its Ray proxy;
            the fleet delivers it every fragment), or None.
    """

    def __init__(self, config: TrainConfig, fleet, learners: Mapping[str, Any], evaluator, tree,
                 on_close: Callable[[], None] | None = None, team_critic=None,
                 make_evaluator: Callable[[], Any] | None = None) -> None:
        self.config, self.fleet, self.learners, self.evaluator, self.tree = config, fleet, dict(learners), evaluator, tree
        self._make_evaluator, self.team_critic = make_evaluator, team_critic
        self.trainable = {pid: lrn for pid, lrn in self.learners.items() if lrn.learns}
        self.weights: dict[str, tuple[int, Any]] = {pid: lrn.published() for pid, lrn in self.learners.items()}
        self.iteration = self.env_steps = 0
        self.history: dict[str, deque[float]] = {}
        """Last 100 finished episodes: ``"return"``, ``"length"``, ``"return/<policy>"``."""
        self.last_episodes: dict[str, list[float]] = {}
        """The episodes that finished during the last iteration, same keys."""
        self.agent_history: dict[str, deque[list[float]]] = {}
        """Group -> every agent's return in the last 100 finished episodes (``[A]`` each)."""
        self._group_specs = groups(tree)
        self._produced = 0
        self._episodes_before = self._episodes_total = 0  # finished episodes before a resume, and in all
        self._started = self._closed = self._warned_past_budget = False  # warned: trained past the annealed budget
        self._actors_restored: bool | None = None  # set by load_state_
        self._final, self._on_close = None, on_close
        self._counters: dict[int, dict[str, dict]] = {}  # worker id -> its latest running totals
        self.envsets = CollectionDriver.from_config(config) if config.collection is not None else None
        """The collection's draws, per-env windows and structure state (None without a collection)."""

    # -- one iteration -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """One iteration; returns its metrics (plain floats)."""
        if self._closed:
            raise RuntimeError("this trainer was closed")
        cfg = self.config
        progress = self.iteration / max(cfg.schedule_iterations, 1)
        lr = cfg.lr * max(0.0, 1.0 - progress) if cfg.anneal_lr else cfg.lr  # set each update: a resumed --lr too
        if lr == 0.0 and not cfg.anneal_iterations and not self._warned_past_budget:  # a Python loop past the budget
            self._warned_past_budget = True
            warnings.warn(f"Trainer.train: iteration {self.iteration + 1} is past TrainConfig.iterations="
                          f"{cfg.iterations}, where the annealed learning rate reached 0: nothing learns any more. "
                          f"Raise iterations (or anneal_iterations), or set anneal_lr=False", stacklevel=2)
        steps_before = self.env_steps
        start = time.perf_counter()
        if self.envsets is not None:  # each actor's member for this iteration, switched at its next boundary
            self.fleet.set_env_ids(self.envsets.draw_())
        metrics, reports, t_collect, t_learn = (self._train_sync if cfg.mode == "sync" else self._train_async)(
            progress, lr)
        self.iteration += 1
        metrics.update(self._episodes())
        metrics.update(self.accounting())
        metrics.update(merge_monitors([r["monitor"] for r in reports]))
        metrics.update(worker_counters(self._counters, reports))  # env faults, past selves
        produced = int(metrics["fragments_produced"])  # env steps: every fragment the fleet produced, counted once
        self.env_steps += (produced - self._produced) * self.fleet.fragment_steps
        self._produced = produced
        wall = time.perf_counter() - start
        new_steps = self.env_steps - steps_before
        # sync: collecting and learning alternate (a rate per collect second); async: they overlap (per wall second)
        sampling_s = t_collect if cfg.mode == "sync" else wall
        metrics.update(iteration=self.iteration, env_steps=self.env_steps, lr=lr, time_collect=t_collect,
                       time_learn=t_learn, time_iteration=wall, env_steps_per_s=new_steps / max(sampling_s, 1e-9),
                       wall_env_steps_per_s=new_steps / max(wall, 1e-9))
        if self.evaluator is not None and cfg.eval_every and self.iteration % cfg.eval_every == 0:
            metrics.update(self.evaluate())
        return metrics

    def _prefixed(self, pid: str, values: Mapping[str, float]) -> dict[str, float]:
        return {f"{pid}/{k}" if len(self.learners) > 1 else k: v for k, v in values.items()}

    def _fresh_steps(self) -> int:
        return min((lrn.new_steps() for lrn in self.trainable.values()), default=0)

    def _take(self, pid: str, result: Mapping[str, Any], metrics: dict[str, float]) -> None:
        self.weights[pid] = (result["version"], result["weights"])
        metrics.update(self._prefixed(pid, result["metrics"]))

    def _train_sync(self, progress: float, lr: float | None):
        start = time.perf_counter()
        reports = self.fleet.collect(self.config.steps_per_iteration, self.weights,
                                     self._fresh_steps if self.trainable else None)
        if any(r.get("push_failures") for r in reports) or self._refresh_weights():
            self._settle()  # deliveries that reached no learner (one was down): lost, so nothing stays in flight
        collected = time.perf_counter()
        critic = self.team_critic
        values = critic.values() if critic is not None else None  # before anyone trains: the batch's values
        pending = {pid: lrn.submit(progress, lr, take_all=True) if values is None or pid not in critic.members
                   else lrn.submit(progress, lr, take_all=True, team_values=values)
                   for pid, lrn in self.trainable.items()}
        critic_request = critic.submit(progress, lr) if critic is not None else None
        metrics: dict[str, float] = {}
        for pid, request in pending.items():  # learners that run apart train in parallel
            result = request.result()  # None: nothing to train on (or the learner died: its batch is lost)
            if result is not None:
                self._take(pid, result, metrics)
        if critic_request is not None and (result := critic_request.result()) is not None:
            metrics.update({f"team_critic/{k}": v for k, v in result["metrics"].items()})
        self._refresh_weights()
        return metrics, reports, collected - start, time.perf_counter() - collected

    def _train_async(self, progress: float, lr: float | None):
        if not self._started:
            self.fleet.start(self.weights)
            self._started = True
        start = last_progress = time.perf_counter()
        metrics: dict[str, float] = {}
        pending = {pid: lrn.submit(progress, lr) for pid, lrn in self.trainable.items()}
        t_learn, arrived = 0.0, sum(self.fleet.reported.values())
        while pending:
            retry = []
            for pid in [p for p, request in pending.items() if request.done()]:
                result = pending.pop(pid).result()
                if result is None:
                    retry.append(pid)
                    continue
                last_progress = time.perf_counter()
                self._take(pid, result, metrics)
                self.fleet.broadcast({pid: self.weights[pid]})
                self.fleet.trained([*result["fragment_ids"], *result["dropped_ids"]], pid)  # after the weights
                t_learn += result["time_learn"]
            if self._refresh_weights(broadcast=True):
                last_progress = time.perf_counter()
            if not pending and not retry:
                break
            try:
                self.fleet.pump(self.weights, hungry=bool(retry))  # local: a round of fragments; Ray: RayFleet.pump
            except CollectionInterrupted:
                if not metrics:
                    raise
                break  # some learners trained in this iteration: it counts (the others train in the next)
            # after the pump: the fleet has had its chance (timed before it, a slow start-up counted as a stall)
            if sum(self.fleet.reported.values()) != arrived:  # fragments keep coming: a big batch fills, slowly
                arrived, last_progress = sum(self.fleet.reported.values()), time.perf_counter()
            if time.perf_counter() - last_progress > self.config.ray.iteration_timeout_s:
                self._stalled(sorted([*pending, *retry]))
            for pid in retry:
                pending[pid] = self.trainable[pid].submit(progress, lr)
        wall = time.perf_counter() - start
        return metrics, self.fleet.monitors(), max(wall - t_learn, 0.0), t_learn

    def _stalled(self, waiting: list[str]) -> None:
        timeout = self.config.ray.iteration_timeout_s
        raise StalledRun(f"learners {waiting} could not train and no fragment arrived for {timeout:g} s "
                         f"(--ray.iteration-timeout-s), with {self._fresh_steps()} of the "
                         f"{self.config.steps_per_iteration} env steps of a batch in hand: are the envs or workers "
                         f"stuck? A longer --ray.iteration-timeout-s waits for them")

    def _refresh_weights(self, broadcast: bool = False) -> bool:
        """Takes weights a learner published outside a training result (a restarted learner resumed from its
        checkpoint); with ``broadcast`` hands them to the fleet. Returns whether any changed."""
        changed = {pid: lrn.published() for pid, lrn in self.trainable.items()
                   if lrn.published()[0] != self.weights[pid][0]}
        self.weights.update(changed)
        if changed and broadcast:
            self.fleet.broadcast(changed)
        return bool(changed)

    def _settle(self) -> None:
        """Counts as lost, at every learner, what the workers produced that it never got (call when every
        worker has flushed: after a synchronous collect, or after stopping)."""
        produced = dict(self.fleet.reported)
        for learner in [*self.trainable.values(), *([self.team_critic] if self.team_critic is not None else [])]:
            learner.settle(produced)

    # -- weights of fixed policies (leagues) -------------------------------------------------------------
    def set_weights(self, policy_id: str, weights: TensorDictBase) -> int:
        """Freezes ``weights`` as the fixed policy ``policy_id`` and loads them into every actor now, before
        the next fragment any of them produces. Returns the new version."""
        learner = self.learners[known(policy_id, "policy", self.learners)]
        if learner.learns:
            raise ValueError(f"policy {policy_id!r} learns; only a fixed policy's weights can be set "
                             f"(fixed: {sorted(p for p, lrn in self.learners.items() if not lrn.learns)})")
        version = learner.replace_weights(weights)
        self.weights[policy_id] = learner.published()
        self.fleet.broadcast({policy_id: self.weights[policy_id]}, wait=True)
        return version

    def reset_learner(self, policy_id: str, state: Mapping[str, Any]) -> int:
        """Starts learning policy ``policy_id`` over from ``state`` (a learner's :meth:`state`, e.g. its first:
        a league exploiter that beat its targets) and loads the weights into every actor now. Weights,
        optimizer and generator come from ``state``; the version moves above every one published before, and
        the counters and inbox go on, so nothing collected is lost or counted twice. Returns the new version."""
        learner = self.trainable[known(policy_id, "learning policy", self.trainable)]
        now = learner.state()
        learner.load_state_({**{k: v for k, v in state.items() if k not in ("inbox", "returns")},
                             "version": int(now["version"]) + 1, "counters": now["counters"]})
        self.weights[policy_id] = learner.published()
        self.fleet.broadcast({policy_id: self.weights[policy_id]}, wait=True)
        return self.weights[policy_id][0]

    # -- statistics and accounting -----------------------------------------------------------------------
    def _episodes(self) -> dict[str, float]:
        drained = self.fleet.episodes()
        by_env = self.envsets.observe_(drained["episodes"]) if self.envsets is not None else {}
        self.last_episodes = {k: list(v) for k, v in drained["episodes"].items() if not k.startswith("agents/")}
        for key, values in self.last_episodes.items():
            self.history.setdefault(key, deque(maxlen=100)).extend(values)
        for key, rows in drained["episodes"].items():
            if key.startswith("agents/"):
                self.agent_history.setdefault(key.split("/", 1)[1], deque(maxlen=100)).extend(rows)
        self._episodes_total = self._episodes_before + int(drained["summary"]["episodes_total"])
        return {"episodes": len(self.last_episodes.get("length", [])), **drained["summary"],
                "episodes_total": float(self._episodes_total), **episode_metrics(self.history),
                **structure_metrics(self.agent_history, self._group_specs), **by_env}

    def learner_reports(self) -> dict[str, dict]:
        """Each learning policy's ledger and counters (``Learner.report()``)."""
        return {pid: lrn.report() for pid, lrn in self.trainable.items()}

    def accounting(self) -> dict[str, float]:
        """Fragment accounting (module docstring) and restarts, as metrics."""
        if self._final is not None:
            return dict(self._final)
        reports = self.learner_reports()
        produced, per_learner = fragment_accounting(reports, self.fleet.reported, self.fleet.dead)
        out: dict[str, float] = {"fragments_produced": produced, "workers_restarted": self.fleet.restarts,
                                 "learners_restarted": sum(r.get("restarts", 0) for r in reports.values())}
        for pid, values in per_learner.items():
            out.update(self._prefixed(pid, values))
        return out

    # -- evaluation, state, shutdown ---------------------------------------------------------------------
    def evaluate(self, episodes: int | None = None) -> dict[str, float]:
        """Mean returns of the deterministic evaluator with the newest weights over ``episodes`` episodes:
        ``eval_return_mean`` (all agents) and, with several policies, ``eval_return_mean/<policy>``. With a
        collection: ``episodes`` in each evaluation env, those keys over all of them and per env id
        (``eval_return_mean/env:<id>``). ``eval_env/<counter>``: the evaluation envs' fault counters."""
        if self._closed:
            raise RuntimeError("this trainer was closed")
        if self.evaluator is None and self._make_evaluator is not None:  # asked for once, without eval_every
            self.evaluator = self._make_evaluator()
        actor = self.evaluator
        if actor is None:
            raise ValueError("this trainer has no evaluation actor (TrainConfig.eval_every is 0)")
        for pid, learner in self.learners.items():  # forced: a restored evaluator holds versions, not weights
            actor.set_weights(pid, *learner.weights(), force=True)
        if (episodes := episodes or self.config.eval_episodes) < 1:
            raise ValueError(f"Trainer.evaluate: episodes must be >= 1, got {episodes}")
        out = evaluate_members(actor, self.envsets.collection.evaluation_ids(), episodes, self._eval_means) \
            if self.envsets is not None else self._eval_means(actor.run_episodes(episodes))
        # what the evaluation envs' adapters repaired or restarted, over the run (as env/<counter> is training's)
        return {**out, **{f"eval_env/{k}": float(v) for k, v in getattr(actor.env, "counters", {}).items()}}

    def _eval_means(self, returns: Mapping[str, list[float]]) -> dict[str, float]:
        out = {}
        for key, values in returns.items():
            if key.startswith("return/") and len(self.learners) < 2:
                continue
            out[key.replace("return", "eval_return_mean", 1)] = sum(values) / max(len(values), 1)
        return out

    @property
    def resume_gaps(self) -> list[str]:
        """Why a run resumed from :meth:`state` would not continue bit for bit ([]: it would): the fleet's reasons
        (:func:`orchestration.fleet.resume_gaps`), else a restored checkpoint that held no worker's state."""
        lost = "the checkpoint holds no worker's state (saved after one was re-created): every env starts afresh"
        return list(self.fleet.resume_gaps) or ([lost] if self._actors_restored is False else [])

    @property
    def resume_exact(self) -> bool:
        return not self.resume_gaps

    def state(self) -> dict[str, Any]:
        """Counters, episode history, every learner's state, the fleet's actors' states, the evaluator's and, with
        a collection, its driver's state (:meth:`CollectionDriver.state_dict`)."""
        return {"iteration": self.iteration, "env_steps": self.env_steps, "produced": self._produced,
                "episodes_total": self._episodes_total, "history": {k: list(v) for k, v in self.history.items()},
                "agent_history": {g: [list(r) for r in rows] for g, rows in self.agent_history.items()},
                "learners": {pid: lrn.state() for pid, lrn in self.learners.items()},
                "actors": self.fleet.state(), "resume_exact": self.resume_exact,
                **({"collection": self.envsets.state_dict()} if self.envsets is not None else {}),
                **({"evaluator": self.evaluator.state()} if self.evaluator is not None else {}),
                **({"team_critic": self.team_critic.state()} if self.team_critic is not None else {})}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Loads a :meth:`state` into a freshly built trainer of the same config; the fleet's actors load the
        restored weights before producing anything."""
        if self._closed:
            raise RuntimeError("this trainer was closed")
        restores_actors = bool(state["actors"]) and bool(self.fleet.state())
        load_learners_(self.learners, state["learners"], keep_inbox=restores_actors)  # first: a misfit changes nothing
        self.weights.update({pid: learner.published() for pid, learner in self.learners.items()})
        self._actors_restored = restores_actors
        self.iteration, self.env_steps = int(state["iteration"]), int(state["env_steps"])
        self._episodes_before = self._episodes_total = int(state.get("episodes_total", 0))  # older runs: 0
        for key, values in state["history"].items():
            self.history.setdefault(key, deque(maxlen=100)).extend(values)
        for group, rows in state.get("agent_history", {}).items():
            self.agent_history.setdefault(group, deque(maxlen=100)).extend(rows)
        if self.team_critic is not None and "team_critic" in state:  # a run saved without one starts it fresh
            critic_state = dict(state["team_critic"])
            if not restores_actors:
                critic_state.pop("inbox", None)
            self.team_critic.load_state_(critic_state)
        self.fleet.broadcast(self.weights, wait=True, force=True)  # every actor acts with the restored weights
        if restores_actors:
            self.fleet.load_state_(state["actors"])
        self._produced = sum(self.fleet.reported.values()) if restores_actors else 0
        if self.envsets is not None and "collection" in state:
            self.envsets.load_state_(state["collection"])
        if self.evaluator is not None and "evaluator" in state:  # its envs and generator: the same evaluations
            with contextlib.suppress(ValueError):  # a new --eval-episodes: other envs, started afresh
                self.evaluator.load_state_(state["evaluator"])

    def interrupt(self) -> None:
        """Safe from a signal handler: a collection that waits for data that may not come (external simulators
        that deliver nothing) gives up, and :meth:`train` raises :class:`orchestration.fleet.CollectionInterrupted`
        unless a learner trained in this iteration (then it returns it): no iteration happened."""
        interrupt = getattr(self.fleet, "interrupt", None)  # a fleet of the user's may lack it: a no-op then
        if interrupt is not None:
            interrupt()

    def close(self) -> None:
        """Stops the fleet, settles the accounting, releases fleet and learners."""
        if self._closed:
            return
        self._closed = True
        try:
            self.fleet.stop()
            self._settle()  # every worker flushed: what a learner never got is lost (in flight only while running)
            self._final = self.accounting()
        finally:  # released even when a learner could not be reached
            try:
                self.fleet.close()
                if self.evaluator is not None:
                    self.evaluator.env.close()
            finally:
                for learner in [*self.learners.values(), self.team_critic]:
                    close = getattr(learner, "close", None)
                    if close is not None:
                        close()
                if self._on_close is not None:
                    self._on_close()


__all__ = ["Trainer"]
