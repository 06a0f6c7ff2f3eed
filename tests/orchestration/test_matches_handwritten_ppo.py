"""Differential test of the whole local PPO stack against a ~150-line hand-written PPO.

Shoal's trainer (gymnasium adapter, actor, fragment builder, learner, torchrl GAE, ``ppo_update_``) and
``benchmarks/handwritten_ppo.py`` (CleanRL style, raw tensors) get the same seed and the same settings. They
build the same initial weights, draw the same Gumbel-max noise from generators seeded alike and minibatch in the
same (env-major) order, so unless some step differs in its arithmetic, every action, advantage and update is the
same. On this machine the parameters after five iterations are equal bit for bit; the test allows 1e-6, because a
matrix product's rounding may depend on the batch size on another CPU (the reference runs its critic per step,
Shoal on the whole batch), and such last-bit differences stay below 1e-6 for the first ~8 iterations. A real
departure moves them far more: normalising advantages by the biased instead of the unbiased std (a 0.2% change)
already leaves a 2e-4 difference after five iterations; a wrong flag, GAE detail, skipped transition or another
minibatch order, more.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from orchestration.config import TrainConfig
from orchestration.builder import build_trainer

ITERATIONS = 5


def _handwritten():
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "handwritten_ppo.py"
    spec = importlib.util.spec_from_file_location("handwritten_ppo_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference runs single-threaded; keep matmul reductions in one order
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [0, 7])
def test_trainer_matches_handwritten_ppo(seed, one_thread):
    cfg = TrainConfig(seed=seed)  # gymnasium CartPole-v1, 16 envs x 64 steps, 4 epochs of minibatch 256
    trainer = build_trainer(cfg)
    for _ in range(ITERATIONS):
        trainer.train()
    ref = _handwritten()
    hand = ref.run(ref.hparams_from_config(cfg), seed=seed, stop_return=float("inf"), max_steps=ITERATIONS * cfg.steps_per_iteration,
                   return_modules=True)
    assert hand["iterations"] == trainer.iteration == ITERATIONS
    policy = next(iter(trainer.learners.values())).policy
    ours = dict(policy.named_parameters())
    pairs = {"actor_trunk.0": hand["actor"][0], "actor_trunk.2": hand["actor"][2], "actor_out": hand["actor"][4],
             "critic_trunk.0": hand["critic"][0], "critic_trunk.2": hand["critic"][2], "critic_out": hand["critic"][4]}
    moved = False
    for name, layer in pairs.items():
        for kind in ("weight", "bias"):
            ours_p, hand_p = ours[f"{name}.{kind}"], getattr(layer, kind)
            diff = (ours_p - hand_p).abs().max().item()
            assert diff <= 1e-6, f"{name}.{kind}: max diff {diff:.3g}"
            if kind == "bias":
                moved |= bool(hand_p.abs().sum() > 0)  # biases start at zero: training happened
    assert moved
