"""The Ray backend's settings (``--ray.*``): modes, placement and bounds; plain data with no Ray import (the Ray
wiring is in ``ray_*.py``). Kept apart from :mod:`orchestration.config`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orchestration.config_kinds import check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class RayConfig:
    """How the Ray backend places and runs the fleet and the learners (no Ray import needed to build one)."""

    queue_size: int = 2
    """Fragments buffered between a worker's sampling loop and its sender thread."""
    max_in_flight: int = 2
    """Pushes per learner a sender thread may have unacknowledged before it waits."""
    num_cpus: float | None = None
    """CPUs of a local Ray instance this backend starts (None: ``os.cpu_count()``, or more if reserved)."""
    worker_num_cpus: float = 1.0
    """Ray CPUs reserved per rollout worker (fractions allowed)."""
    worker_num_gpus: float = 0.0
    """Ray GPUs reserved per rollout worker (fractions allowed), for tensor envs that step on CUDA
    (``--env-kwargs device=cuda``): a worker sees a GPU only when it reserves one. The learners' ``auto`` share
    and the central inference server take the GPUs the workers leave."""
    learner_num_cpus: float = 1.0
    """Ray CPUs reserved per learner."""
    learner_num_gpus: float | Literal["auto"] = "auto"
    """GPUs per learner process; ``auto``: share the cluster's GPUs among every learner process (data-parallel
    ranks included) when it has any, else 0."""
    learners_per_policy: int = 1
    """Processes training each policy data-parallel (torch.distributed, gradients averaged); above 1, every
    batch is split by env rows into equal shards, so its env rows must divide evenly. Each rank's minibatches
    are ``--ppo.minibatch-size``: a step averages N of them (divide it by N to keep one learner's steps)."""
    learner_resources: tuple[tuple[str, float], ...] = ()
    """Custom Ray resources per learner, e.g. ``(("learner_node", 1),)`` to pin learners to a node."""
    worker_strategy: Literal["DEFAULT", "SPREAD"] = "DEFAULT"
    """Ray scheduling strategy of rollout workers (``SPREAD``: across nodes)."""
    max_worker_restarts: int = 100
    """Re-creations of dead rollout workers allowed over the run before it fails."""
    max_learner_restarts: int = 3
    """Restarts of each learner process Ray may make after it dies (each resumes from the learner's last
    checkpoint) before the run fails."""
    learner_checkpoint_every: int = 10
    """Iterations between the learners' in-memory checkpoints (object store, owned by the driver) that a
    restarted learner resumes from; checkpoints written to disk refresh them too. 0: only those."""
    resolve_timeout_s: float = 30.0
    """A learner gives up fetching a pushed fragment after this long (counted lost)."""
    worker_threads: int = 1
    """torch threads per rollout worker."""
    worker_niceness: int | None = 0
    """Niceness of Ray's worker processes when this backend starts a local Ray (``RAY_worker_niceness``, unless
    already set). Ray's own default, 15, lets any busy process on the machine take the CPU from the rollout
    workers and learners, which do all of the run's work. None keeps Ray's default; a joined cluster its own."""
    learner_threads: int = 1
    """torch threads per learner."""
    poll_interval_s: float = 0.002
    """Async mode: pause between readiness polls of the learners."""
    iteration_timeout_s: float = 600.0
    """Async mode: fail when no learner could train for this long."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("max_worker_restarts", "max_learner_restarts", "learner_checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"RayConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("queue_size", "max_in_flight", "worker_threads", "learner_threads",
                     "learners_per_policy"):
            if getattr(self, name) < 1:
                raise ValueError(f"RayConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name, ok, rule in (("worker_num_cpus", self.worker_num_cpus >= 0, ">= 0"),
                               ("learner_num_cpus", self.learner_num_cpus >= 0, ">= 0"),
                               ("num_cpus", self.num_cpus is None or self.num_cpus > 0, "> 0 (or left out)"),
                               ("iteration_timeout_s", self.iteration_timeout_s > 0, "> 0"),
                               ("poll_interval_s", self.poll_interval_s >= 0, ">= 0")):
            if not ok:
                raise ValueError(f"--ray.{name.replace('_', '-')} must be {rule}, got {getattr(self, name)!r}")
        if not self.worker_num_gpus >= 0:
            raise ValueError(f"--ray.worker-num-gpus must be >= 0, got {self.worker_num_gpus!r}")
        if self.learner_num_gpus != "auto" and not self.learner_num_gpus >= 0:
            raise ValueError(f"--ray.learner-num-gpus must be auto or >= 0, got {self.learner_num_gpus!r}")


__all__ = ["RayConfig"]
