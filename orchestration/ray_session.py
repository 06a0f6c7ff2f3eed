"""Joining or starting Ray for a run, checking that the run's reservations fit the cluster, and the two
tolerant calls on actor handles that may have died (:func:`try_get`, :func:`kill_actor`).

:func:`init_ray` is the only ``ray.init`` of the project (the composition root,
:func:`orchestration.ray_backend.build_ray_trainer`, calls it).
"""

from __future__ import annotations

import math
import os
import warnings

import ray

from orchestration.config import RayConfig, TrainConfig


def init_ray(config: TrainConfig, ray_config: RayConfig, min_cpus: float = 0.0) -> bool:
    """Connects this process to Ray; returns True when this call started or joined it (and owns shutdown).

    Order: an already initialised Ray (a test session, a Tune trial) is reused; else ``config.address``,
    else ``RAY_ADDRESS`` is joined; else a local instance starts with ``ray_config.num_cpus`` CPUs (default:
    ``os.cpu_count()``, raised to ``min_cpus``: Ray's CPUs are scheduling slots, and a local run should not
    fail because its reservations exceed the cores) and ``ray_config.worker_niceness``.
    """
    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, configure_logging=False)
    else:
        num_cpus = ray_config.num_cpus or max(os.cpu_count() or 1, math.ceil(min_cpus))
        if ray_config.worker_niceness is not None:  # read by Ray when it starts its worker processes
            os.environ.setdefault("RAY_worker_niceness", str(ray_config.worker_niceness))
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    return True


def cpus_needed(config: TrainConfig, ray_config: RayConfig, num_learners: int) -> float:
    return (config.rollout.num_workers * ray_config.worker_num_cpus
            + num_learners * ray_config.learners_per_policy * ray_config.learner_num_cpus)


def check_resources(config: TrainConfig, ray_config: RayConfig, num_learners: int, strict: bool) -> None:
    need = cpus_needed(config, ray_config, num_learners)
    have = ray.cluster_resources().get("CPU", 0.0)
    if need > have + 1e-9:
        message = (f"the Ray backend reserves {need:g} CPUs ({config.rollout.num_workers} workers x "
                   f"{ray_config.worker_num_cpus:g} + {num_learners} learners x {ray_config.learner_num_cpus:g}) "
                   f"but the cluster has {have:g}: lower RayConfig.worker_num_cpus / learner_num_cpus")
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)


def try_get(ref, timeout: float | None = None):
    """``ray.get``, or None when the actor died, the call failed or ``timeout`` passed."""
    try:
        return ray.get(ref, timeout=timeout)
    except (ray.exceptions.RayError, TimeoutError):
        return None


def kill_actor(handle) -> None:
    """``ray.kill`` without restart; an actor that is already gone is fine."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass


__all__ = ["check_resources", "cpus_needed", "init_ray", "kill_actor", "try_get"]
