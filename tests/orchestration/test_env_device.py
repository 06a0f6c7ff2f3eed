"""Tensor envs on a device (issue 18): an actor acts where its env steps (``--env-kwargs device=cuda``), so env,
inference, fragments and training share one device. The CUDA runs need a GPU (skipped without one: CI has
none); the refusal of stand-in policies runs anywhere, with an env on the ``meta`` device."""

from __future__ import annotations

import pytest
import torch

from adapters.builtin import CartPole, CartPoleConfig
from core.policies import PolicyConfig, make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign
from orchestration.builder import build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.run_state import restore_trainer_, trainer_state
from orchestration.service_policy import ServicePolicy


class _MetaCartPole:
    """A built-in CartPole whose steps claim the ``meta`` device (no data: the actor is only built)."""

    def __init__(self) -> None:
        self.env = CartPole(CartPoleConfig(num_envs=2))
        self.tree, self.num_envs = self.env.tree, 2

    def reset(self, seed=None):
        return self.env.reset(seed=seed).to("meta")


def test_a_stand_in_policy_on_an_env_off_the_cpu_is_refused_by_name():
    """The central inference service's stand-ins (and past selves' pools) take CPU steps: an env stepping elsewhere
    is refused naming the policy, the env's device and the flag that keeps it on the CPU, before anything acts."""
    env = _MetaCartPole()
    stand_in = ServicePolicy("agent", service=None, like=make_policies(env.tree)["agent"])
    with pytest.raises(ValueError, match=r"policy 'agent' acts through ServicePolicy, which takes CPU steps, but the "
                                         r"env _MetaCartPole steps on meta: pass --env-kwargs device=cpu"):
        Actor(env, {"agent": stand_in}, assign(env.tree))


def test_an_actor_off_the_cpu_restores_its_envs_generator_states_as_cpu_byte_tensors():
    """A resumed actor moves its observations and flags to its device, but not the env's state: generator states
    are CPU byte tensors on every device (torch refuses others) and an env moves the rest itself. ``meta`` stands
    in for CUDA (set after a CPU start: it cannot step); the env's load raised TypeError before."""
    env = CartPole(CartPoleConfig(num_envs=2))
    actor = Actor(env, make_policies(env.tree), assign(env.tree), fragment_length=4)
    actor.collect()
    state = actor.state()
    actor.device = torch.device("meta")
    actor.load_state_(state)
    assert actor.builder.tracker.episode_count.device.type == "meta"  # the actor's own tensors moved
    assert torch.equal(env.state_dict()["rng"], state["tensors"]["env/rng"])  # the env's generator restored


def _cuda_config(backend: str = "local", **kwargs) -> TrainConfig:
    return TrainConfig(env="builtin:cartpole", env_kwargs=(("device", "'cuda'"),), device="cuda", backend=backend,
                       iterations=3, eval_every=1, eval_episodes=4, policy=PolicyConfig(scale_rewards=True),
                       rollout=RolloutConfig(num_envs=256, fragment_length=16, **kwargs.pop("rollout", {})), **kwargs)


@pytest.mark.gpu
def test_a_cuda_run_with_reward_scaling_resumes_exactly():
    """The checkpoint holds CPU tensors; a resumed trainer moves each where it acts: the actors' observations,
    the envs' states (their generators stay CPU byte tensors), the return accumulators beside CUDA rewards."""
    whole = build_trainer(_cuda_config())
    try:
        whole.train()
        saved = trainer_state(whole)
        expected = whole.train()
    finally:
        whole.close()
    resumed = build_trainer(_cuda_config())
    try:
        restore_trainer_(resumed, *saved)
        got = resumed.train()
    finally:
        resumed.close()
    for key in ("loss_policy", "loss_value", "grad_norm", "reward_scale", "episode_return_mean"):
        assert got.get(key) == expected.get(key), key


@pytest.mark.gpu
def test_a_cuda_cartpole_acts_records_and_trains_on_cuda_and_its_actor_state_round_trips():
    trainer = build_trainer(_cuda_config())
    try:
        for _ in range(2):
            metrics = trainer.train()
        actor = trainer.fleet.actors[0]
        assert actor.device.type == "cuda" and actor.generator.device.type == "cuda"
        assert next(actor.policies["agent"].parameters()).device.type == "cuda"
        assert metrics["env_steps"] == 2 * 256 * 16 and metrics["episodes"] > 0 and "eval_return_mean" in metrics
        state = actor.state()
        assert all(t.device.type == "cpu" for t in state["tensors"].values())  # checkpoints hold CPU tensors
        before = actor.collect()
        actor.load_state_(state)
        again = actor.collect()
        assert before.device is None or before.device.type == "cuda"
        assert torch.equal(before.get(("agent", "action")), again.get(("agent", "action")))  # resumed exactly
        assert actor.policy_weights("agent").device.type == "cpu"
    finally:
        trainer.close()


@pytest.mark.gpu
def test_ray_rollout_workers_with_a_gpu_share_step_cuda_envs(ray_session):
    trainer = build_trainer(_cuda_config("ray", rollout={"num_workers": 2}, ray=RayConfig(worker_num_gpus=0.25)))
    try:
        metrics = trainer.train()
        assert metrics["env_steps"] == 2 * 256 * 16 and metrics["fragments_lost"] == 0
    finally:
        trainer.close()
