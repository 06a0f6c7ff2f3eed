"""Run statistics of the Ray backend: an ``EpisodeStatistics`` actor and each worker's ``PipelineMonitor``.

Seed 004: rollout workers report completed episodes to a central statistics actor and keep a per-stage
monitor of their pipeline. Neither blocks sampling: episodes travel from the worker's sender thread as a
fire-and-forget call (awaited only when a synchronous collect flushes), and the monitor is read by a call
that a threaded worker serves beside its sampling loop.

Both classes are plain (usable without Ray); this module imports neither torch nor anything heavy, so the
statistics actor's process starts in well under a second.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Mapping

import numpy as np
import ray

#: Stages timed by :class:`PipelineMonitor` (seconds summed over a reporting window).
STAGES = ("env_step", "inference", "assembly", "enqueue_wait", "serialize_put", "send_wait")


class PipelineMonitor:
    """Per-stage times of one rollout worker's pipeline, thread-safe, read and reset once per report.

    Stages: ``env_step`` (the env's ``step``), ``inference`` (the rest of an actor step: policy forward,
    sampling, recording), ``assembly`` (steps -> fragment TensorDict), ``enqueue_wait`` (the sampling loop
    blocked on a full queue: back-pressure), ``serialize_put`` (sender thread: ``to_wire`` + ``ray.put``),
    ``send_wait`` (sender thread waiting for learners' acknowledgements).
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
    """Delegates to a batched env and sums the seconds spent in its ``step`` (``elapsed``)."""

    def __init__(self, env) -> None:
        self._env, self.elapsed = env, 0.0

    def step(self, actions):
        start = time.perf_counter()
        out = self._env.step(actions)
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


def episode_arrays(records: Mapping[str, Any], assignment: Mapping[str, Any]) -> dict[str, Any]:
    """Completed-episode records (``FragmentBuilder.pop_completed_episodes``) as small numpy arrays.

    Keys as the local actor's ``completed_episodes``: ``"return"`` (all agents summed), ``"return/<policy>"``
    (the agents that policy acts for, via ``assignment`` slots), ``"length"``, all ``[K]``; plus
    ``"agents/<group>"`` ``[K, A]``, every agent's own return (``K`` may be 0). ``{}`` before any fragment.
    """
    if not records:
        return {}
    per_policy, agents = {}, {}
    for group, r in records.items():  # the same tensor ops as Actor.completed_episodes: the same floats
        agent_return = r.get("agent_return").squeeze(-1)  # [K, A]
        agents[f"agents/{group}"] = agent_return.double().numpy()
        for pid, slots in assignment[group].slots.items():
            part = (agent_return * slots).sum(-1)
            per_policy[pid] = per_policy[pid] + part if pid in per_policy else part
    import torch  # workers have it loaded; the statistics actor's process never runs this

    out = {f"return/{pid}": v.double().numpy() for pid, v in per_policy.items()}
    out["return"] = torch.stack(list(per_policy.values())).sum(0).double().numpy()
    out["length"] = next(iter(records.values())).get("length").reshape(-1).double().numpy()
    return {**out, **agents}


class EpisodeStatistics:
    """Aggregates completed episodes from all rollout workers: overall, per policy and per agent.

    Keeps the last ``window`` episodes of every agent and the episodes added since the last :meth:`drain`,
    from which the driver computes exactly the local trainer's episode metrics.
    """

    def __init__(self, window: int = 100) -> None:
        self.window = window
        self.history: dict[str, deque] = {}
        self.total_episodes = 0
        self.by_worker: dict[int, int] = {}
        self._new: list[tuple[int, int, Mapping[str, Any]]] = []

    def add(self, worker_id: int, sequence: int, episodes: Mapping[str, Any]) -> int:
        """Records the episodes of fragment ``sequence`` of a worker (:func:`episode_arrays`); returns how many."""
        if not episodes:
            return 0
        for key, values in episodes.items():
            if key.startswith("agents/"):
                self.history.setdefault(key, deque(maxlen=self.window)).extend(list(np.asarray(values)))
        self._new.append((worker_id, sequence, episodes))  # even with no episode: the keys exist, as locally
        count = len(episodes["length"])
        self.total_episodes += count
        self.by_worker[worker_id] = self.by_worker.get(worker_id, 0) + count
        return count

    def summary(self) -> dict[str, float]:
        """Running means over the window: every agent slot's return (``episode_return_mean/agent/<g>/<i>``)."""
        out = {"episodes_total": float(self.total_episodes)}
        for key, rows in self.history.items():
            if key.startswith("agents/") and rows:
                for slot, value in enumerate(np.mean(np.stack(list(rows)), axis=0).tolist()):
                    out[f"episode_return_mean/agent/{key.split('/', 1)[1]}/{slot}"] = value
        return out

    def drain(self) -> dict[str, Any]:
        """``{"episodes": {key: values added since the last drain}, "summary": summary()}``.

        Episodes come in (worker, fragment) order whatever order they arrived in: the local trainer's order,
        so a synchronous run's running means match the local backend's exactly.
        """
        new, self._new = sorted(self._new, key=lambda item: item[:2]), []
        out: dict[str, list] = {}
        for _, _, episodes in new:
            for key, values in episodes.items():
                if not key.startswith("agents/"):
                    out.setdefault(key, []).extend(np.asarray(values).tolist())
        return {"episodes": out, "summary": self.summary()}


def fragment_accounting(reports: Mapping[str, Mapping], reported: Mapping[int, int],
                        dead: set[int]) -> tuple[int, dict[str, dict[str, float]]]:
    """Classifies every fragment the fleet produced, per learner: ``accepted``, ``stale``, ``lost``, ``in_flight``.

    Args:
        reports: policy id -> ``LearnerServer.report()`` (per-worker ledgers with the highest sequence heard).
        reported: worker id -> fragments the worker reported producing (its last report).
        dead: worker ids of dead incarnations.

    A worker produced ``max(highest sequence heard + 1, reported)`` fragments. What a learner never heard of
    is ``lost`` for a dead worker and ``in_flight`` for a live one, so per learner
    ``accepted + stale + lost + in_flight == produced`` holds exactly.

    Returns:
        ``(produced, {policy id: {"fragments_accepted", ..., "weights_serializations", "policy_version"}})``.
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
                      trained_max_lag=counters["max_trained_lag"], weights_serializations=counters["serializations"],
                      policy_version=report["version"])
        out[pid] = values
    return sum(produced.values()), out


#: The statistics actor: light (no CPU reserved), made remote once.
RemoteEpisodeStatistics = ray.remote(num_cpus=0)(EpisodeStatistics)

__all__ = ["STAGES", "EpisodeStatistics", "PipelineMonitor", "RemoteEpisodeStatistics", "TimedEnv", "episode_arrays",
           "fragment_accounting", "merge_monitors"]
