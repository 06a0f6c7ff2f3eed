"""A Ray run's wiring: joining or starting Ray (:func:`init_ray`, the project's only ``ray.init``), checking
reservations, placing the learner, statistics and fleet actors (:func:`build_ray_parts`, called by
:func:`orchestration.builder.build_trainer`), and two tolerant calls on handles (:func:`try_get`, :func:`kill_actor`).
"""

from __future__ import annotations

import math
import os
import uuid
import warnings
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tensordict import TensorDict

from core.specs import Tree, to_json
from orchestration.addresses import check_reachable
from orchestration.config import RayConfig, TrainConfig
from orchestration.placement import (cpus_needed, gpu_holders, gpu_problem, inference_gpus, learner_gpus,
                                    learner_processes, learner_restarts, reservation_problem, resource_problem,
                                    side_by_side, worker_gpus)
from orchestration.signals import held_interrupts, kept_sigterm


@kept_sigterm()  # ray.init installs a SIGTERM handler of its own
def init_ray(config: TrainConfig, ray_config: RayConfig, min_cpus: float = 0.0) -> bool:
    """Connects to Ray; True when this call started or joined it (and owns shutdown): Ray already up is reused,
    else ``--address`` / ``RAY_ADDRESS`` is joined, else a local instance starts with ``ray_config.num_cpus`` CPUs
    (default: the cores, raised to ``min_cpus``: Ray's CPUs are scheduling slots)."""
    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address:
        flag = "--address" if config.address else "RAY_ADDRESS"
        check_reachable(address, flag)  # ray.init retries an address where nothing listens for minutes
        try:
            ray.init(address=address, configure_logging=False)
        except ConnectionError as error:
            raise ValueError(f"cannot join a Ray cluster at {flag} {address!r}: {error} Start one "
                             f"(`ray start --head`) or leave out {flag} for a local Ray instance") from None
    else:
        num_cpus = ray_config.num_cpus or max(os.cpu_count() or 1, math.ceil(min_cpus))
        if ray_config.worker_niceness is not None:  # read by Ray when it starts its worker processes
            os.environ.setdefault("RAY_worker_niceness", str(ray_config.worker_niceness))
        with held_interrupts():  # Ray's processes start with Ctrl-C blocked; ours comes once they are up
            ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    return True


def check_resources(config: TrainConfig, ray_config: RayConfig, num_learners: int, strict: bool,
                    trainers: int = 1) -> None:
    """Warns (``strict``: raises ValueError) when the run does not fit the cluster's CPUs, GPUs or resources."""
    have = ray.cluster_resources()
    holders = trainers * gpu_holders(ray_config, num_learners)
    problem = (reservation_problem(config, ray_config, num_learners, have.get("CPU", 0.0), trainers)
               or gpu_problem(config, ray_config, holders, have.get("GPU", 0.0), trainers)
               or resource_problem(ray_config, num_learners, have, trainers, config.env != "external"))
    if problem and strict:
        raise ValueError(problem)
    if problem:
        warnings.warn(problem, stacklevel=3)


def init_ray_for(config: TrainConfig, trainers: int) -> tuple[Callable[[], None] | None, TrainConfig]:
    """:func:`init_ray` with room for ``trainers`` trainers of ``config`` side by side, one learning policy
    each (a league's players), checked strictly. Returns ``ray.shutdown`` when this call started Ray (else None)
    and the config each trainer is built from (:func:`orchestration.placement.side_by_side`: its GPU share)."""
    owns = init_ray(config, config.ray, trainers * cpus_needed(config, config.ray, 1))
    try:
        check_resources(config, config.ray, 1, strict=True, trainers=trainers)
    except ValueError:
        if owns:
            ray.shutdown()
        raise
    return ray.shutdown if owns else None, side_by_side(config, trainers, ray.cluster_resources().get("GPU", 0.0))


def try_get(ref, timeout: float | None = None):
    """``ray.get``, or None when the actor died, the call failed or ``timeout`` passed."""
    try:
        return ray.get(ref, timeout=timeout)
    except (ray.exceptions.RayError, TimeoutError):
        return None


def kill_actor(handle) -> None:
    """``ray.kill`` without restart (one already gone is fine)."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass


def build_ray_learners(config: TrainConfig, tree: Tree, policies: Mapping[str, Any], fixed: set[str],
                       teams: Sequence = (), wait: bool = True) -> tuple[dict[str, Any], Any, dict, Callable[[], None]]:
    """Ray, the learner actors (one per learning policy, started from ``policies``) and, given ``teams``, the
    team critic's: ``(policy id -> RayLearner, RayTeamCritic or None, placement of light actors, teardown)``.
    ``wait``: until every learner is built (else the caller calls :func:`await_started`); a failure leaves
    nothing. The teardown kills the registry and the critic, and ends a Ray instance this call started."""
    from orchestration.assignment import groups_of
    from orchestration.builder import assignment_for
    from orchestration.ray_learner import (RayLearner, RayTeamCritic, RemoteLearner, RemoteLearnerCheckpoints,
                                           RemoteRank, RemoteTeamCritic)
    from orchestration.wire import to_wire

    rc = config.ray
    trained = [pid for pid in policies if pid not in fixed]
    placed = learner_processes(config, len(trained))
    owns_ray = init_ray(config, rc, cpus_needed(config, rc, placed))
    joined = bool(config.address or os.environ.get("RAY_ADDRESS"))
    check_resources(config, rc, placed, strict=owns_ray and not joined)
    holders = gpu_holders(rc, len(trained), critics=int(bool(teams)))  # the critic is placed as a learner
    left = max(ray.cluster_resources().get("GPU", 0.0) - worker_gpus(config, rc), 0.0)  # what the workers leave
    gpus = learner_gpus(rc.learner_num_gpus, left, holders, config.device)
    options = {"num_cpus": rc.learner_num_cpus, "num_gpus": gpus,
               **({"resources": dict(rc.learner_resources)} if rc.learner_resources else {})}
    initial = {pid: [ray.put(to_wire(TensorDict.from_module(policies[pid]).detach()))] for pid in trained}
    # The checkpoint registry stays near the driver (it reserves nothing, so it never competes with the
    # learners for pinned resources); statistics live beside the learners when they are pinned.
    near_driver = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                         soft=True)}
    placement = {"resources": dict(rc.learner_resources)} if rc.learner_resources else near_driver
    registry_name = f"shoal-learner-checkpoints-{uuid.uuid4().hex}"  # the learners look it up by name
    registry = RemoteLearnerCheckpoints.options(name=registry_name, max_restarts=-1, **near_driver).remote()
    for pid, refs in initial.items():  # the learners read them there (see LearnerServer)
        registry.set_initial.remote(pid, refs)
    handles = {pid: RemoteLearner.options(max_restarts=learner_restarts(rc), **options).remote(
        pid, config, to_json(tree), None, resolve_timeout_s=rc.resolve_timeout_s, num_threads=rc.learner_threads,
        checkpoints=registry_name) for pid in trained}
    critic = RayTeamCritic(RemoteTeamCritic.options(max_restarts=0, **options).remote(
        config, to_json(tree), teams, resolve_timeout_s=rc.resolve_timeout_s, num_threads=rc.learner_threads),
        [p for t in teams for p in t.policies]) if teams else None
    peers: dict[str, list] = {pid: [] for pid in trained}

    def teardown() -> None:
        for actor in [registry, *([critic.handle] if critic else [])]:
            kill_actor(actor)
        if owns_ray:
            ray.shutdown()

    if rc.learners_per_policy > 1:  # rank 0 is the learner actor; its peers train shards of every batch
        assignment, world = assignment_for(config, tree), rc.learners_per_policy
        try:  # the rendezvous waits for every rank: a failed one leaves nothing of the group behind
            for pid, server in handles.items():
                peers[pid] = [RemoteRank.options(**options).remote(
                    policies[pid], groups_of(assignment, pid), ppo=config.ppo, lr=config.lr,
                    batch_steps=config.steps_per_iteration // world, seed=config.seed,
                    device=config.device) for _ in range(world - 1)]  # resolved as rank 0's is, in its process
                address, port = ray.get(server.rendezvous.remote())
                ray.get([server.join_data_parallel.remote(peers[pid], address, port)]
                        + [peer.join.remote(r, world, address, port) for r, peer in enumerate(peers[pid], 1)])
        except BaseException:
            for actor in [*handles.values(), *(p for group in peers.values() for p in group)]:
                kill_actor(actor)
            teardown()
            raise
    # A fresh learner's version-0 weights are the ones it was given: workers may start from them meanwhile.
    learners = {pid: RayLearner(pid, h, registry, checkpoint_every=rc.learner_checkpoint_every,
                                restart_timeout_s=rc.iteration_timeout_s, peers=peers[pid],
                                initial=(0, initial[pid])) for pid, h in handles.items()}
    if wait:
        await_started(learners, teardown)
    return learners, critic, placement, teardown


def await_started(learners: Mapping[str, Any], teardown: Callable[[], None]) -> None:
    """Waits until every learner actor is built; on an error discards them (:func:`discard_learners`)."""
    try:
        ray.get([learner.started() for learner in learners.values()])
    except BaseException:
        discard_learners(learners, teardown)
        raise


def discard_learners(learners: Mapping[str, Any], teardown: Callable[[], None], others: Sequence[Any] = ()) -> None:
    """Kills ``others`` and every learner's actor and peers, then runs ``teardown`` (a failed build leaves nothing)."""
    for actor in others:
        kill_actor(actor)
    for learner in learners.values():
        learner.close()  # its actor and data-parallel peers
    teardown()


def build_ray_parts(config: TrainConfig, tree: Tree, policies: Mapping[str, Any], fixed: set[str],
                    teams: Sequence = ()) -> tuple[Any, dict[str, Any], Any, Callable[[], None]]:
    """:func:`build_ray_learners`, the statistics actor and the fleet: ``(fleet, policy id -> RayLearner,
    RayTeamCritic or None, teardown)``. The workers start while the learners do (each imports torch)."""
    from orchestration.ray_fleet import RayFleet, RemoteEpisodeStatistics
    from orchestration.team_critic import TEAM_CRITIC

    learners, critic, placement, teardown = build_ray_learners(config, tree, policies, fixed, teams, wait=False)
    handles = {**{pid: lrn.handle for pid, lrn in learners.items()}, **({TEAM_CRITIC: critic.handle} if critic else {})}
    weights = {pid: lrn.published() for pid, lrn in learners.items()}
    weights.update({pid: (0, TensorDict.from_module(policies[pid]).detach()) for pid in fixed})
    stats = RemoteEpisodeStatistics.options(max_restarts=-1, **placement).remote()
    inference = None
    if config.rollout.central_inference:  # one server for every worker, on a GPU when the cluster has one
        from orchestration.inference import InferenceConfig
        from orchestration.service_policy import InferenceServer

        gpus = inference_gpus(config.ray, ray.cluster_resources().get("GPU", 0.0) - worker_gpus(config, config.ray),
                              len(learners), int(critic is not None), config.device)
        inference = ray.remote(InferenceServer).options(  # a thread per caller; more queue in Ray
            max_concurrency=64, num_cpus=0, num_gpus=gpus).remote(
            dict(policies), InferenceConfig(device="cuda" if gpus else "cpu", seed=config.seed))
    try:
        fleet = RayFleet(config, config.ray, handles, stats, weights, inference, consumers=len(learners))
    except BaseException:  # (RayFleet kills the workers it started)
        discard_learners(learners, teardown, [stats, *([inference] if inference else [])])
        raise
    await_started(learners, lambda: (fleet.close(), teardown()))
    return fleet, learners, critic, teardown


__all__ = ["await_started", "build_ray_learners", "build_ray_parts", "check_resources", "discard_learners",
           "init_ray", "kill_actor", "try_get"]
