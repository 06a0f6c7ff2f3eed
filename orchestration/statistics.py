"""Run statistics, the same on every backend: episode statistics, the per-stage pipeline monitor, fragment
accounting and the episode metrics a trainer reports.

Seed 004: rollout workers report completed episodes to a central :class:`EpisodeStatistics` (an object in a
local run, a light Ray actor on Ray) and keep a per-stage :class:`PipelineMonitor` of their pipeline. Neither
blocks sampling. This module imports neither torch nor Ray, so the statistics actor's process starts fast.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

#: Stages timed by :class:`PipelineMonitor` (seconds summed over a reporting window).
STAGES = ("env_step", "inference", "assembly", "enqueue_wait", "credit_wait", "serialize_put", "send_wait")


class PipelineMonitor:
    """Per-stage times of one rollout worker's pipeline, thread-safe, read and reset once per report.

    Stages: ``env_step`` (the env's ``step``), ``inference`` (the rest of an actor step: policy forward,
    sampling, recording), ``assembly`` (steps -> fragment TensorDict), ``enqueue_wait`` (the sampling loop
    blocked on a full queue: back-pressure), ``credit_wait`` (asynchronous mode on Ray: waiting for the
    learners to train on what the fleet made, :mod:`orchestration.sampling_credit`), ``serialize_put`` (sender
    thread: ``to_wire`` + ``ray.put``), ``send_wait`` (sender thread waiting for learners' acknowledgements).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._times = dict.fromkeys(STAGES, 0.0)
        self._fragments = 0
        self._sent = 0
        self._env_steps = 0
        self._depth_sum = 0
        self._depth_max = 0
        self._since = time.perf_counter()

    def add(self, stage: str, seconds: float) -> None:
        """Adds ``seconds`` to ``stage``."""
        with self._lock:
            self._times[stage] += seconds

    def fragment_built(self, env_steps: int, queue_depth: int) -> None:
        """Counts one fragment handed to the queue, which then held ``queue_depth`` items."""
        with self._lock:
            self._fragments += 1
            self._env_steps += env_steps
            self._depth_sum += queue_depth
            self._depth_max = max(self._depth_max, queue_depth)

    def fragment_sent(self) -> None:
        """Counts one fragment put in the object store and handed to the learners."""
        with self._lock:
            self._sent += 1

    def snapshot(self, reset: bool = True) -> dict[str, float]:
        """Seconds per stage, ms per fragment per stage, queue depth mean/max, rates, over the window."""
        with self._lock:
            wall = max(time.perf_counter() - self._since, 1e-9)
            n = self._fragments
            out: dict[str, float] = {f"{s}_s": t for s, t in self._times.items()}
            out.update({f"{s}_ms_per_fragment": (t * 1e3 / n if n else math.nan) for s, t in self._times.items()})
            out.update(fragments=n, fragments_sent=self._sent, env_steps=self._env_steps, wall_s=wall,
                       env_steps_per_s=self._env_steps / wall,
                       queue_depth_mean=self._depth_sum / n if n else math.nan, queue_depth_max=self._depth_max)
            if reset:
                self._reset()
            return out


class TimedEnv:
    """Delegates to a batched env and sums the seconds spent in its ``step`` (``elapsed``); for an env pool
    driven by polling (``send`` / ``poll``), the seconds spent waiting in ``poll``."""

    def __init__(self, env) -> None:
        self._env, self.elapsed = env, 0.0

    def step(self, actions):
        start = time.perf_counter()
        out = self._env.step(actions)
        self.elapsed += time.perf_counter() - start
        return out

    def poll(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._env.poll(*args, **kwargs)
        self.elapsed += time.perf_counter() - start
        return out

    def __getattr__(self, name: str):
        return getattr(self._env, name)


def merge_monitors(snapshots: list[Mapping[str, float]]) -> dict[str, float]:
    """One ``pipeline/*`` metrics dict from several workers' snapshots (times summed, rates summed)."""
    snapshots = [s for s in snapshots if s]
    if not snapshots:
        return {}
    n = sum(s["fragments"] for s in snapshots)
    out = {"pipeline/fragments": n, "pipeline/env_steps_per_s": sum(s["env_steps_per_s"] for s in snapshots),
           "pipeline/queue_depth_max": max(s["queue_depth_max"] for s in snapshots)}
    depths = [s["queue_depth_mean"] * s["fragments"] for s in snapshots if s["fragments"]]
    out["pipeline/queue_depth_mean"] = sum(depths) / n if n else math.nan
    for stage in STAGES:
        total = sum(s[f"{stage}_s"] for s in snapshots)
        out[f"pipeline/{stage}_ms"] = total * 1e3 / n if n else math.nan
    return out


def worker_counters(latest: dict[int, dict], reports: list[Mapping[str, Any]]) -> dict[str, float]:
    """Metrics of the workers' running totals (``latest``: worker id -> the newest each reported, updated from
    ``reports``): ``env/<name>`` summed (env faults: lenient truncations, restarts, timeouts; external traffic);
    with past selves, ``past_selves/pool_size`` (the largest pool) and ``past_selves/game_share`` (games with a
    past self in a seat, of the games started)."""
    for report in reports:
        latest[report["worker_id"]] = {"env": report.get("env_counters", {}), "past": report.get("past_selves", {})}
    envs, past = [c["env"] for c in latest.values()], [c["past"] for c in latest.values() if c["past"]]
    out = {f"env/{name}": float(sum(c.get(name, 0) for c in envs)) for name in sorted({k for c in envs for k in c})}
    if past:
        out["past_selves/pool_size"] = float(max(p["pool_size"] for p in past))
        out["past_selves/game_share"] = sum(p["past_self_games"] for p in past) / max(sum(p["games"] for p in past), 1)
    return out


class EpisodeStatistics:
    """Aggregates completed episodes from all rollout workers: overall, per policy and per agent.

    Keeps the episodes added since the last :meth:`drain`, from which the driver computes exactly the local
    trainer's episode metrics (its windows are part of its checkpoint; nothing here needs one).
    """

    def __init__(self) -> None:
        self.total_episodes = 0
        self.by_worker: dict[int, int] = {}
        self._new: list[tuple[int, int, Mapping[str, Any]]] = []

    def add(self, worker_id: int, sequence: int, episodes: Mapping[str, Any]) -> int:
        """Records the episodes of fragment ``sequence`` of a worker (:func:`episode_arrays`); returns how many."""
        if not episodes:
            return 0
        self._new.append((worker_id, sequence, episodes))  # even with no episode: the keys exist, as locally
        count = len(episodes["length"])
        self.total_episodes += count
        self.by_worker[worker_id] = self.by_worker.get(worker_id, 0) + count
        return count

    def summary(self) -> dict[str, float]:
        """``episodes_total``: episodes added since this aggregator started."""
        return {"episodes_total": float(self.total_episodes)}

    def drain(self) -> dict[str, Any]:
        """``{"episodes": {key: values added since the last drain}, "summary": summary()}``.

        Episodes come in (worker, fragment) order whatever order they arrived in: the local trainer's order,
        so a synchronous run's running means match the local backend's exactly.
        """
        new, self._new = sorted(self._new, key=lambda item: item[:2]), []
        out: dict[str, list] = {}
        for _, _, episodes in new:
            for key, values in episodes.items():  # "agents/<group>": one [A] list per episode
                out.setdefault(key, []).extend(np.asarray(values).tolist())
        return {"episodes": out, "summary": self.summary()}


def fragment_accounting(reports: Mapping[str, Mapping], reported: Mapping[int, int],
                        dead: set[int]) -> tuple[int, dict[str, dict[str, float]]]:
    """Classifies every fragment the fleet produced, per learner: ``accepted``, ``stale``, ``lost``, ``in_flight``.

    Args:
        reports: policy id -> ``Learner.report()`` (per-worker ledgers with the highest sequence heard).
        reported: worker id -> fragments the worker reported producing (its last report).
        dead: worker ids of dead incarnations.

    A worker produced ``max(highest sequence heard + 1, reported)`` fragments. What a learner never heard of
    is ``lost`` for a dead worker and ``in_flight`` for a live one, so per learner
    ``accepted + stale + lost + in_flight == produced`` holds exactly.

    Returns:
        ``(produced, {policy id: {"fragments_accepted", ..., "weights_serializations", "policy_version",
        "env_steps_trained"}})``; ``env_steps_trained`` sums the env steps of the batches the learner trained on
        (a batch once, whatever its epochs; a fragment reused by the inbox once per use).
    """
    heard: dict[int, int] = {}
    for report in reports.values():
        for wid, w in report["workers"].items():
            heard[int(wid)] = max(heard.get(int(wid), 0), w["max_seq"] + 1)
    produced = {w: max(heard.get(w, 0), reported.get(w, 0)) for w in set(heard) | set(reported)}
    out = {}
    for pid, report in reports.items():
        counts = {"accepted": 0, "stale": 0, "lost": 0, "in_flight": 0}
        for wid, made in produced.items():
            w = report["workers"].get(wid, {"accepted": 0, "stale": 0, "lost": 0})
            for state in ("accepted", "stale", "lost"):
                counts[state] += w[state]
            counts["lost" if wid in dead else "in_flight"] += made - (w["accepted"] + w["stale"] + w["lost"])
        values: dict[str, float] = {f"fragments_{k}": v for k, v in counts.items()}
        counters = report["counters"]
        values.update(fragments_duplicate=counters["duplicates"], fragments_max_uses=counters["max_uses"],
                      trained_max_lag=counters["max_trained_lag"], policy_version=report["version"])
        if "serializations" in counters:  # Ray learners: weights put in the object store once per version (and
            # once more per resume or restart: the restored version)
            values["weights_serializations"] = counters["serializations"]
        trained = report.get("learner", {}).get("env_steps_trained")
        if trained is not None:  # in async mode env_steps counts what the fleet sampled, this what was learnt from
            values["env_steps_trained"] = trained
        out[pid] = values
    return sum(produced.values()), out


def episode_metrics(history: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Means over the last finished episodes: ``episode_return_mean`` (100), ``episode_return_mean_10``,
    ``episode_length_mean`` and, with several policies, ``episode_return_mean/<policy>``."""
    out: dict[str, float] = {}
    several = sum(k.startswith("return/") for k in history) > 1
    for key, window in history.items():
        if key.startswith("return/") and not several:
            continue
        name = {"return": "episode_return_mean", "length": "episode_length_mean"}.get(
            key, key.replace("return/", "episode_return_mean/"))
        out[name] = sum(window) / len(window) if window else math.nan
    last10 = list(history.get("return", []))[-10:]
    out["episode_return_mean_10"] = sum(last10) / len(last10) if last10 else math.nan
    out.setdefault("episode_return_mean", math.nan)
    return out


def structure_metrics(agent_history: Mapping[str, Sequence[Sequence[float]]],
                      group_specs: Mapping[str, Any]) -> dict[str, float]:
    """Metrics that follow the population's structure, over the last finished episodes of each group.

    Every group: ``episode_return_mean/group/<g>`` (its agents' returns summed: a team's return, reported
    per group so that opposing groups never add up) and each agent slot's ``episode_return_mean/agent/<g>/<i>``
    (from the trainer's window, which a checkpoint holds: a resumed run's means go on). Zero-sum populations:
    ``win_rate/<agent>``, ``draw_rate/<agent>``, ``loss_rate/<agent>`` per seat (return > 0, == 0, < 0),
    since their summed return is always 0.

    Args:
        agent_history: group -> per-episode ``[A]`` returns of its agents.
        group_specs: :func:`core.specs.groups` of the env's tree (names, agent names, payoff).
    """
    out: dict[str, float] = {}
    for group, spec in group_specs.items():
        rows = np.asarray(list(agent_history.get(group, [])), dtype=np.float64).reshape(-1, spec.capacity)
        if not len(rows):
            continue
        out[f"episode_return_mean/group/{group}"] = float(rows.sum(1).mean())
        for slot, value in enumerate(rows.mean(0).tolist()):
            out[f"episode_return_mean/agent/{group}/{slot}"] = value
        if spec.payoff == "zero_sum":
            for slot, agent in enumerate(spec.agent_names):
                out[f"win_rate/{agent}"] = float((rows[:, slot] > 0).mean())
                out[f"draw_rate/{agent}"] = float((rows[:, slot] == 0).mean())
                out[f"loss_rate/{agent}"] = float((rows[:, slot] < 0).mean())
    return out


__all__ = ["STAGES", "EpisodeStatistics", "PipelineMonitor", "TimedEnv", "episode_metrics", "fragment_accounting",
           "merge_monitors", "structure_metrics", "worker_counters"]
