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


def episode_arrays(records: Mapping[str, Any]) -> dict[str, Any]:
    """Completed-episode records per group (``FragmentBuilder.pop_completed_episodes``) as small numpy arrays.

    Returns ``{}`` when no episode ended, else ``{"length": [K], "return": [K] (team return summed over
    groups), "groups": {group: {"team_return": [K], "agent_return": [K, A], "agent_length": [K, A]}}}``.
    """
    if not records or next(iter(records.values())).batch_size[0] == 0:
        return {}
    groups = {}
    for group, r in records.items():
        groups[group] = {"team_return": r.get("team_return").reshape(-1).double().numpy(),
                         "agent_return": r.get("agent_return").squeeze(-1).double().numpy(),
                         "agent_length": r.get("agent_length").numpy()}
    total = np.sum([g["team_return"] for g in groups.values()], axis=0)
    return {"length": next(iter(records.values())).get("length").reshape(-1).numpy(), "return": total,
            "groups": groups}


class EpisodeStatistics:
    """Aggregates completed episodes from all rollout workers: overall, per group, per agent and per policy.

    Args:
        group_to_policy: group -> policy id (a policy's return sums the groups mapped to it).
        window: episodes kept for the running means (the local trainer's 100).
    """

    def __init__(self, group_to_policy: Mapping[str, str], window: int = 100) -> None:
        self.group_to_policy = dict(group_to_policy)
        self.window = window
        self.returns: deque[float] = deque(maxlen=window)
        self.lengths: deque[float] = deque(maxlen=window)
        self.group_returns = {g: deque(maxlen=window) for g in self.group_to_policy}
        self.agent_returns: dict[str, deque] = {g: deque(maxlen=window) for g in self.group_to_policy}
        self.policy_returns = {p: deque(maxlen=window) for p in set(self.group_to_policy.values())}
        self.total_episodes = 0
        self.by_worker: dict[int, int] = {}
        self._new: tuple[list[float], list[float]] = ([], [])

    def add(self, worker_id: int, episodes: Mapping[str, Any]) -> int:
        """Records the episodes of one fragment (:func:`episode_arrays`); returns how many."""
        if not episodes:
            return 0
        returns, lengths = np.asarray(episodes["return"]), np.asarray(episodes["length"])
        self.returns.extend(returns.tolist())
        self.lengths.extend(lengths.astype(float).tolist())
        self._new[0].extend(returns.tolist())
        self._new[1].extend(lengths.astype(float).tolist())
        per_policy: dict[str, np.ndarray] = {}
        for group, g in episodes["groups"].items():
            self.group_returns[group].extend(np.asarray(g["team_return"]).tolist())
            self.agent_returns[group].extend(list(np.asarray(g["agent_return"])))
            pid = self.group_to_policy[group]
            per_policy[pid] = per_policy.get(pid, 0.0) + np.asarray(g["team_return"])
        for pid, value in per_policy.items():
            self.policy_returns[pid].extend(np.asarray(value).tolist())
        self.total_episodes += len(returns)
        self.by_worker[worker_id] = self.by_worker.get(worker_id, 0) + len(returns)
        return len(returns)

    def summary(self) -> dict[str, float]:
        """Running means over the window: overall, per group, per agent slot and per policy."""
        out = {"episodes_total": float(self.total_episodes),
               "episode_return_mean": _mean(self.returns), "episode_length_mean": _mean(self.lengths)}
        for group, values in self.group_returns.items():
            out[f"episode_return_mean/group/{group}"] = _mean(values)
            agents = self.agent_returns[group]
            if agents:
                for slot, value in enumerate(np.mean(np.stack(list(agents)), axis=0).tolist()):
                    out[f"episode_return_mean/agent/{group}/{slot}"] = value
        for pid, values in self.policy_returns.items():
            out[f"episode_return_mean/policy/{pid}"] = _mean(values)
        return out

    def drain(self) -> dict[str, Any]:
        """Returns and lengths of the episodes added since the last drain, plus :meth:`summary`."""
        (returns, lengths), self._new = self._new, ([], [])
        return {"returns": returns, "lengths": lengths, "summary": self.summary()}


def _mean(values) -> float:
    return float(sum(values) / len(values)) if values else math.nan


#: The statistics actor: light (no CPU reserved), made remote once.
RemoteEpisodeStatistics = ray.remote(num_cpus=0)(EpisodeStatistics)

__all__ = ["STAGES", "EpisodeStatistics", "PipelineMonitor", "RemoteEpisodeStatistics", "TimedEnv", "episode_arrays",
           "merge_monitors"]
