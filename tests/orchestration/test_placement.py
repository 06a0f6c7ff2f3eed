"""What a Ray run reserves (:mod:`orchestration.placement`): pure arithmetic, checked without Ray."""

from __future__ import annotations

import pytest

from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.placement import (cpus_needed, gpu_holders, gpu_problem, inference_gpus, learner_gpus,
                                    reservation_problem, resource_problem, side_by_side)


def _config(workers: int = 2) -> TrainConfig:
    return TrainConfig(env="builtin:cartpole", backend="ray", rollout=RolloutConfig(num_workers=workers))


def test_cpus_needed_counts_workers_and_every_data_parallel_rank():
    rc = RayConfig(worker_num_cpus=0.5, learner_num_cpus=1.0, learners_per_policy=3)
    assert cpus_needed(_config(4), rc, num_learners=2) == 4 * 0.5 + 2 * 3 * 1.0


def test_a_run_that_fits_has_no_problem_and_one_that_does_not_names_the_flags():
    rc = RayConfig(worker_num_cpus=1.0, learner_num_cpus=1.0)
    assert reservation_problem(_config(2), rc, 1, have=3.0) is None
    problem = reservation_problem(_config(2), rc, 1, have=2.0)
    assert problem is not None and "reserves 3 CPUs (2 workers x 1 + 1 learners x 1)" in problem
    assert "has 2" in problem and "--ray.worker-num-cpus" in problem and "--ray.num-cpus" in problem
    # trainers side by side (a league's players) multiply the reservation
    assert reservation_problem(_config(2), rc, 1, have=3.0, trainers=2).startswith("the Ray backend reserves 6 CPUs (2 trainers x")


@pytest.mark.parametrize("asked, cluster, learners, expected", [
    ("auto", 0.0, 2, 0.0),      # no GPU: the CPU
    ("auto", 1.0, 2, 0.5),      # one GPU shared by two learners
    ("auto", 4.0, 2, 1.0),      # at most one each
    (0.25, 4.0, 2, 0.25),       # as asked
    (0, 4.0, 2, 0.0),
])
def test_learner_gpus(asked, cluster, learners, expected):
    assert learner_gpus(asked, cluster, learners) == expected


@pytest.mark.parametrize("asked, per_policy, cluster, learners, expected", [
    ("auto", 1, 1.0, 1, 0.0),   # the learner takes the only GPU: inference on the CPU
    ("auto", 1, 2.0, 1, 1.0),   # one left over
    ("auto", 2, 4.0, 1, 1.0),   # two ranks take one each; two left, at most one for inference
    ("auto", 2, 2.0, 1, 0.0),   # the ranks take both
    (0, 1, 1.0, 2, 1.0),        # CPU learners leave the GPU to inference
    (0.4, 1, 1.0, 2, 0.2),      # a fifth left: enough to place it
    (0.5, 1, 1.0, 2, 0.0),
])
def test_inference_gets_what_the_learners_leave(asked, per_policy, cluster, learners, expected):
    rc = RayConfig(learner_num_gpus=asked, learners_per_policy=per_policy)
    assert inference_gpus(rc, cluster, learners) == pytest.approx(expected)


def test_a_team_critic_takes_its_gpu_share_before_inference():
    # two learners and a critic share 2 GPUs (2/3 each, as they are placed): nothing left for inference
    assert inference_gpus(RayConfig(), 2.0, 2, critics=1) == 0.0
    assert inference_gpus(RayConfig(learner_num_gpus=0.5), 2.0, 2, critics=1) == pytest.approx(0.5)
    assert inference_gpus(RayConfig(learner_num_gpus=0.5), 2.0, 2) == pytest.approx(1.0)


def test_the_message_counts_data_parallel_ranks():
    rc = RayConfig(worker_num_cpus=1.0, learner_num_cpus=1.0, learners_per_policy=2)
    problem = reservation_problem(_config(1), rc, 1, have=2.0)
    assert "reserves 3 CPUs (1 workers x 1 + 1 learners x 2 ranks x 1)" in problem


def test_data_parallel_ranks_that_cannot_share_a_batch_evenly_are_refused_before_ray_starts():
    rollout = RolloutConfig(num_envs=15)
    with pytest.raises(ValueError, match=r"--ray.learners-per-policy 2: .* a batch holds 15 \(--rollout.num-envs 15 "
                                         r"x --rollout.num-workers 1\); make it a multiple of 2"):
        TrainConfig(backend="ray", rollout=rollout, ray=RayConfig(learners_per_policy=2))
    TrainConfig(backend="ray", rollout=rollout, ray=RayConfig(learners_per_policy=3))  # 15 rows: 5 each
    TrainConfig(backend="local", rollout=rollout, ray=RayConfig(learners_per_policy=2))  # not used locally


def test_auto_shares_the_gpus_among_every_data_parallel_rank():
    # one GPU, one policy trained by two ranks: half each (a whole one each left rank 1 waiting for ever)
    rc = RayConfig(learners_per_policy=2)
    holders = gpu_holders(rc, 1)
    assert holders == 2 and learner_gpus("auto", 1.0, holders) == 0.5
    assert gpu_problem(_config(), rc, holders, have=1.0) is None
    assert gpu_holders(rc, 2, critics=1) == 5


@pytest.mark.parametrize("asked, per_policy, have, named", [
    (1.0, 1, 0.0, "--ray.learner-num-gpus 1 asks for 1 GPU but the cluster has 0"),
    (1.0, 2, 1.0, "--ray.learner-num-gpus 1 asks for 2 GPUs (2 learner processes) but the cluster has 1"),
    (0.5, 2, 1.0, None),
])
def test_gpus_a_cluster_cannot_give_are_named_with_the_flag(asked, per_policy, have, named):
    rc = RayConfig(learner_num_gpus=asked, learners_per_policy=per_policy)
    problem = gpu_problem(_config(), rc, gpu_holders(rc, 1), have)
    assert problem == named if named is None else named in problem and "--ray.learner-num-gpus auto" in problem


def test_a_cuda_learner_without_a_gpu_is_named_with_the_device_flag():
    config = TrainConfig(env="builtin:cartpole", backend="ray", device="cuda")
    problem = gpu_problem(config, config.ray, 1, have=0.0)
    assert problem.startswith("--device cuda: the learners get no GPU (the cluster has 0")
    assert gpu_problem(config, config.ray, 1, have=1.0) is None
    assert gpu_problem(TrainConfig(env="builtin:cartpole", backend="ray"), config.ray, 1, have=0.0) is None  # auto


def test_negative_learner_gpus_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--ray.learner-num-gpus must be auto or >= 0, got -1"):
        RayConfig(learner_num_gpus=-1)


def test_a_cpu_device_takes_no_gpu_for_learners_or_inference_unless_asked():
    """--device cpu on a GPU cluster: "auto" reserves nothing (a learner or the inference server would hold a GPU
    it never uses, and the server would act on CUDA against the flag); an explicit count is still honoured."""
    assert learner_gpus("auto", 2.0, 2, device="cpu") == 0.0
    assert learner_gpus("auto", 2.0, 2, device="auto") == 1.0 and learner_gpus(0.5, 2.0, 2, device="cpu") == 0.5
    assert inference_gpus(RayConfig(), 4.0, 1, device="cpu") == 0.0
    assert inference_gpus(RayConfig(), 4.0, 1, device="cuda:0") == 1.0


def test_rollout_workers_gpus_come_first_and_the_learners_share_what_they_leave():
    """--ray.worker-num-gpus (tensor envs on CUDA in the workers): more than the cluster has is named with the flag;
    the learners' GPUs are checked against what the workers leave, so a CUDA learner left none is named too."""
    config = TrainConfig(env="builtin:cartpole", backend="ray", device="cuda",
                         rollout=RolloutConfig(num_workers=4), ray=RayConfig(worker_num_gpus=0.5))
    assert gpu_problem(config, config.ray, 1, have=3.0) is None  # 2 for the workers, 1 left for the learner
    left_none = gpu_problem(config, config.ray, 1, have=2.0)
    assert left_none.startswith("--device cuda: the learners get no GPU")
    too_many = gpu_problem(config, config.ray, 1, have=1.0)
    assert too_many.startswith("--ray.worker-num-gpus 0.5 asks for 2 GPUs (4 workers) but the cluster has 1")
    assert "e.g. 0.25" in too_many
    two_trainers = gpu_problem(config, config.ray, 1, have=3.0, trainers=2)
    assert two_trainers.startswith("--ray.worker-num-gpus 0.5 asks for 4 GPUs (8 workers)")
    with pytest.raises(ValueError, match="--ray.worker-num-gpus must be >= 0, got -1"):
        RayConfig(worker_num_gpus=-1)
    one = TrainConfig(env="builtin:cartpole", backend="ray", ray=RayConfig(worker_num_gpus=0.5))
    assert gpu_problem(one, one.ray, 1, have=0.0) == (  # no GPU at all: fewer workers would not help
        "--ray.worker-num-gpus 0.5 asks for 0.5 GPUs (1 worker) but the cluster has 0: leave it at 0: the workers' "
        "envs then step on the CPU (--env-kwargs device cpu)")


def test_trainers_side_by_side_share_the_gpus_their_workers_leave_among_all_of_their_learners():
    """A league's players: each trainer alone shared the cluster's GPUs among its own learner, so two players on
    one GPU asked for one each and the second waited for ever."""
    config = TrainConfig(env="builtin:cartpole", backend="ray", rollout=RolloutConfig(num_workers=1))
    assert side_by_side(config, 2, cluster_gpus=1.0).ray.learner_num_gpus == 0.5
    workers = TrainConfig(env="builtin:cartpole", backend="ray", ray=RayConfig(worker_num_gpus=0.25))
    assert side_by_side(workers, 2, cluster_gpus=1.0).ray.learner_num_gpus == 0.25  # (1 - 2 x 0.25) / 2
    assert side_by_side(config, 2, cluster_gpus=0.0).ray.learner_num_gpus == 0.0
    explicit = TrainConfig(env="builtin:cartpole", backend="ray", ray=RayConfig(learner_num_gpus=1.0))
    assert side_by_side(explicit, 2, cluster_gpus=4.0) is explicit


def test_custom_resources_count_every_learner_process_and_the_statistics_actor():
    rc = RayConfig(learner_resources=(("pinned", 0.5),), learners_per_policy=2)
    assert resource_problem(rc, 2, {"pinned": 2.5}) is None  # 2 learners x 2 ranks + statistics: 5 x 0.5
    problem = resource_problem(rc, 2, {"pinned": 2.0})
    assert problem is not None and "the learners and the statistics actor reserve 2.5 of Ray resource 'pinned' " \
        "and the cluster has 2" in problem
    assert resource_problem(rc, 2, {"pinned": 2.5}, trainers=2) is not None
    assert resource_problem(rc, 2, {"pinned": 2.0}, statistics=False) is None  # external runs have no statistics actor
    assert resource_problem(RayConfig(), 2, {}) is None
    # a team critic is one of the learner actors counted (check_resources passes learner_processes): not twice
    one = RayConfig(learner_resources=(("pinned", 1.0),))
    assert resource_problem(one, 2, {"pinned": 3.0}) is None
