"""What a Ray run reserves: CPUs for its workers and learners, and how it shares the cluster's GPUs between
the learners (every data-parallel rank) and a central inference server. Plain arithmetic on the config and the
cluster's totals (the Ray calls that read those and place the actors are in :mod:`orchestration.ray_session`)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from orchestration.config import RayConfig, TrainConfig


def cpus_needed(config: TrainConfig, ray_config: RayConfig, num_learners: int) -> float:
    """CPUs one trainer of ``config`` with ``num_learners`` learning policies reserves."""
    return (config.rollout.num_workers * ray_config.worker_num_cpus
            + num_learners * ray_config.learners_per_policy * ray_config.learner_num_cpus)


def reservation_problem(config: TrainConfig, ray_config: RayConfig, num_learners: int, have: float,
                        trainers: int = 1) -> str | None:
    """Why ``trainers`` trainers of ``config`` side by side, each with ``num_learners`` learning policies, do not
    fit in a cluster of ``have`` CPUs (some actors would wait for ever), naming the flags that lower the
    reservation; None when they fit."""
    need = trainers * cpus_needed(config, ray_config, num_learners)
    if need <= have + 1e-9:
        return None
    times = f"{trainers} trainers x " if trainers > 1 else ""
    ranks = f" x {ray_config.learners_per_policy} ranks" if ray_config.learners_per_policy > 1 else ""
    return (f"the Ray backend reserves {need:g} CPUs ({times}{config.rollout.num_workers} workers x "
            f"{ray_config.worker_num_cpus:g} + {num_learners} learners{ranks} x {ray_config.learner_num_cpus:g}) "
            f"but the cluster has {have:g}: lower --ray.worker-num-cpus / --ray.learner-num-cpus (e.g. 0.5)"
            f" or raise --ray.num-cpus")


def resource_problem(ray_config: RayConfig, num_learners: int, have: Mapping[str, float], trainers: int = 1,
                     statistics: bool = True) -> str | None:
    """Why the custom resources that ``num_learners`` learner actors (a team critic counted among them) and the
    statistics actor (external runs have none) reserve (``--ray.learner-resources``) are not in a cluster that
    ``have`` (their actors would wait for ever); None when they are."""
    actors = trainers * (gpu_holders(ray_config, num_learners) + int(statistics))
    for name, amount in ray_config.learner_resources:
        if actors * amount > have.get(name, 0.0) + 1e-9:
            who = "the learners and the statistics actor" if statistics else "the learners"
            return (f"--ray.learner-resources {name} {amount:g}: {who} reserve "
                    f"{actors * amount:g} of Ray resource {name!r} and the cluster has {have.get(name, 0.0):g}: start "
                    f"Ray with it (ray start --head --resources '{{\"{name}\": {actors * amount:g}}}') and join it "
                    f"with --address, or leave --ray.learner-resources out")
    return None


def on_cpu(device: str) -> bool:
    """Whether ``--device`` asks for the CPU (then ``"auto"`` GPU reservations take none: they would sit idle)."""
    return device.split(":")[0] == "cpu"


def learner_gpus(num_gpus: float | str, cluster_gpus: float, holders: int, device: str = "auto") -> float:
    """GPUs of one learner process: ``"auto"`` shares the cluster's GPUs (at most one each) among ``holders``
    processes (every learner's data-parallel ranks, team critics) when it has any and ``device`` is not the CPU."""
    if num_gpus == "auto":
        return min(1.0, cluster_gpus / holders) if cluster_gpus and not on_cpu(device) else 0.0
    return float(num_gpus)


def worker_gpus(config: TrainConfig, ray_config: RayConfig) -> float:
    """GPUs the rollout workers reserve (``--ray.worker-num-gpus`` each); the learners share what they leave."""
    return config.rollout.num_workers * ray_config.worker_num_gpus


def side_by_side(config: TrainConfig, trainers: int, cluster_gpus: float) -> TrainConfig:
    """``config`` for each of ``trainers`` trainers run side by side (a league's players, one learning policy
    each): ``--ray.learner-num-gpus auto`` becomes the share of every trainer's learner processes in what all of
    their rollout workers leave (each trainer alone would share the cluster's GPUs among its own learners)."""
    rc = config.ray
    if rc.learner_num_gpus != "auto":
        return config
    have = max(cluster_gpus - trainers * worker_gpus(config, rc), 0.0)
    share = learner_gpus("auto", have, trainers * gpu_holders(rc, 1), config.device)
    return dataclasses.replace(config, ray=dataclasses.replace(rc, learner_num_gpus=share))


def gpu_holders(ray_config: RayConfig, num_learners: int, critics: int = 0) -> int:
    """Processes that each take a learner's GPUs: every data-parallel rank of ``num_learners`` learners, and
    ``critics`` team critics (placed as learners)."""
    return num_learners * ray_config.learners_per_policy + critics


def learner_processes(config: TrainConfig, learning: int) -> int:
    """Learner actors a Ray run of ``config`` with ``learning`` learning policies places (and reserves CPUs for):
    one per policy, and a team critic, which is placed as a learner."""
    return learning + int(config.team_critic.enabled)


def learner_restarts(ray_config: RayConfig) -> int:
    """Ray restarts of a learner actor: ``max_learner_restarts``, but none in a data-parallel group (the death of
    its rank 0 takes the group down: its peers cannot join a restarted one)."""
    return ray_config.max_learner_restarts if ray_config.learners_per_policy == 1 else 0


def gpu_problem(config: TrainConfig, ray_config: RayConfig, holders: int, have: float,
                trainers: int = 1) -> str | None:
    """Why ``holders`` learner processes of ``config`` cannot get their GPUs in a cluster of ``have`` (some would
    wait for ever, or a CUDA learner would get none), naming the flags at fault; None when they can. The rollout
    workers' GPUs (:func:`worker_gpus`) are taken first."""
    if (workers := trainers * worker_gpus(config, ray_config)) > have + 1e-9:
        count = trainers * config.rollout.num_workers
        way = (f"lower it (fractions share a GPU, e.g. {have / count:.2g}) or --rollout.num-workers" if have else
               "leave it at 0: the workers' envs then step on the CPU (--env-kwargs device cpu)")
        return (f"--ray.worker-num-gpus {ray_config.worker_num_gpus:g} asks for {workers:g} GPU"
                f"{'' if workers == 1 else 's'} ({count} worker{'' if count == 1 else 's'}) but the cluster has "
                f"{have:g}: {way}")
    have -= workers
    gpus = learner_gpus(ray_config.learner_num_gpus, have, holders, config.device)
    if gpus * holders > have + 1e-9:
        ranks = f" ({holders} learner processes)" if holders > 1 else ""
        return (f"--ray.learner-num-gpus {ray_config.learner_num_gpus:g} asks for {gpus * holders:g} GPU"
                f"{'' if gpus * holders == 1 else 's'}{ranks} but "
                f"the cluster has {have:g}: use --ray.learner-num-gpus auto (shares the GPUs there are) or 0")
    if gpus == 0 and config.device.startswith("cuda"):
        return (f"--device {config.device}: the learners get no GPU (the cluster has {have:g}, --ray.learner-num-gpus "
                f"{ray_config.learner_num_gpus}); use --device auto (CUDA where a learner has a GPU) or cpu")
    return None


def inference_gpus(ray_config: RayConfig, cluster_gpus: float, num_learners: int, critics: int = 0,
                   device: str = "auto") -> float:
    """GPUs of the central inference server: what the learners (each with its data-parallel ranks) and ``critics``
    team critics (placed as learners) leave, at most one; else none (the CPU), as with ``--device cpu``."""
    holders = gpu_holders(ray_config, num_learners, critics)
    left = cluster_gpus - learner_gpus(ray_config.learner_num_gpus, cluster_gpus, holders, device) * holders
    return min(1.0, left) if left >= 0.1 and not on_cpu(device) else 0.0


__all__ = ["cpus_needed", "gpu_holders", "gpu_problem", "inference_gpus", "learner_gpus", "learner_processes",
           "learner_restarts", "on_cpu", "reservation_problem"]
