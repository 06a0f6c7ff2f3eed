"""``--ppo.compute-dtype bfloat16``: every kind of policy trains under autocast, on both backends, and learns."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.distributed_config import RayConfig
from orchestration.team_critic_config import TeamCriticConfig

BF16 = PPOConfig(compute_dtype="bfloat16", minibatch_size=64, num_epochs=2)
SMALL = RolloutConfig(num_envs=4, fragment_length=16)
RECURRENT = PolicyConfig(recurrent=True, recurrent_critic=True, recurrent_size=16, hidden_sizes=(16,))

KINDS = {
    "mlp": TrainConfig(env="builtin:cartpole"),
    "image": TrainConfig(env="builtin:spot", policy=PolicyConfig(image_encoder="impala", image_features=32)),
    "gru_sequences": TrainConfig(env="builtin:recall", policy=RECURRENT,
                                 ppo=dataclasses.replace(BF16, sequence_length=8, burn_in=2)),
    "lstm": TrainConfig(env="builtin:recall", policy=dataclasses.replace(RECURRENT, recurrent_cell="lstm")),
    "joint_critic": TrainConfig(env="builtin:spread", policy=PolicyConfig(critic="joint")),
    "team_critic": TrainConfig(env="builtin:spread", team_critic=TeamCriticConfig(enabled=True),
                               policy_mapping=(("agents_0", "a"), ("agents_1", "b"), ("agents_2", "c"))),
}


PRODUCTS = {torch.nn.functional.linear, torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.baddbmm,
            torch.Tensor.matmul, torch.Tensor.__matmul__, torch.nn.functional.conv2d}


class MatmulDtypes(TorchFunctionMode):
    """Records the dtypes the matrix products and convolutions run inside it put out (every policy's layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in PRODUCTS:
            self.seen.add(out.dtype)
        return out


def _bf16(config: TrainConfig, **fields) -> TrainConfig:
    ppo = config.ppo if config.ppo.compute_dtype == "bfloat16" else BF16
    return dataclasses.replace(config, **{"ppo": ppo, "rollout": SMALL, "iterations": 2, "seed": 0, "loggers": (),
                                          **fields})


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_policy_trains_in_bfloat16_and_keeps_float32_weights(kind):
    trainer = build_trainer(_bf16(KINDS[kind]))
    try:
        before = {pid: {k: v.clone() for k, v in learner.policy.state_dict().items()}
                  for pid, learner in trainer.learners.items()}
        computed = MatmulDtypes()
        in_critic = MatmulDtypes()  # what the team critic's own nets compute in
        if trainer.team_critic is not None:
            for net in trainer.team_critic.nets:
                net.register_forward_pre_hook(lambda m, i: None if in_critic.__enter__() else None)
                net.register_forward_hook(lambda m, i, out: in_critic.__exit__(None, None, None))
        for _ in range(2):
            with computed:
                metrics = trainer.train()
        losses = {k: v for k, v in metrics.items() if "loss_" in k}
        assert losses and all(math.isfinite(v) for v in losses.values()), losses
        assert not any(v for k, v in metrics.items() if k.endswith("skipped_steps")), metrics
        for pid, learner in trainer.learners.items():
            after = learner.policy.state_dict()
            assert all(v.dtype == before[pid][k].dtype for k, v in after.items()), pid  # float32 stays float32
            assert any(not torch.equal(v, before[pid][k]) for k, v in after.items()), pid  # it trained
        assert computed.seen >= {torch.float32, torch.bfloat16}, computed.seen  # acting in float32, updates in bf16
        if kind == "team_critic":
            assert math.isfinite(metrics["team_critic/loss_value"]) and torch.bfloat16 in in_critic.seen
    finally:
        trainer.close()


@pytest.mark.slow
def test_cartpole_reaches_195_within_a_step_budget_in_bfloat16():
    """The float32 learning test's run (``test_local_training.py``), with the update in bfloat16."""
    config = TrainConfig(env="CartPole-v1", seed=1, lr=2.5e-3, anneal_lr=True, iterations=60,
                         rollout=RolloutConfig(num_envs=16, fragment_length=64),
                         ppo=PPOConfig(minibatch_size=256, num_epochs=4, compute_dtype="bfloat16"))
    trainer = build_trainer(config)
    best = 0.0
    for _ in range(config.iterations):  # budget: 60 x 1024 = 61,440 env steps
        best = max(best, trainer.train()["episode_return_mean_10"])
        if best >= 195:
            break
    assert best >= 195, f"mean return of the last 10 episodes peaked at {best:.1f} after {trainer.env_steps} steps"


@pytest.mark.ray
def test_the_ray_backend_trains_in_the_dtype_it_is_given_as_the_local_one_does(ray_session):
    """A synchronous Ray run reproduces the local run: in bfloat16 too, so the setting reached its learners."""
    def losses(config: TrainConfig) -> list[float]:
        trainer = build_trainer(config)
        try:
            return [trainer.train()["loss_policy"] for _ in range(2)]
        finally:
            trainer.close()

    config = _bf16(KINDS["mlp"], rollout=dataclasses.replace(SMALL, num_workers=1))
    local, in_float32 = losses(config), losses(dataclasses.replace(config, ppo=dataclasses.replace(
        BF16, compute_dtype="float32")))
    remote = losses(dataclasses.replace(config, backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0)))
    assert remote == local != in_float32


def test_bfloat16_on_a_gpu_without_it_is_refused_naming_the_flag(monkeypatch):
    from orchestration.devices import check_compute_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a GPU before Ampere
    with pytest.raises(ValueError, match=r"--ppo.compute-dtype bfloat16: the GPU cuda:0 has no bfloat16 support; use "
                                         r"--ppo.compute-dtype float32"):
        check_compute_dtype(torch.device("cuda:0"), "bfloat16")
    check_compute_dtype(torch.device("cuda:0"), "float32")
    check_compute_dtype(torch.device("cpu"), "bfloat16")  # emulated where the CPU lacks it: slower, not wrong
