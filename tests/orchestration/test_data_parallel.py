"""Data-parallel learners without Ray: two ``torch.multiprocessing`` ranks (gloo, CPU) of
:class:`orchestration.data_parallel.DataParallelRank`, each training its shard through DistributedDataParallel,
against one :class:`PPOLearner` on the whole batch."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.assignment import assign, groups_of
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.data_parallel import DataParallelRank, free_port, shard_by_rows
from orchestration.learner import PPOLearner
from orchestration.wire import to_wire

pytestmark = pytest.mark.slow

WORLD, ROWS, STEPS = 2, 8, 16  # each fragment [ROWS, STEPS]; two fragments make the batch
# Full-batch minibatches and no advantage normalisation: the mean of the two shards' gradients is then the
# whole batch's gradient, so two ranks must step as one learner on the concatenated batch (up to rounding).
PPO = PPOConfig(num_epochs=2, minibatch_size=ROWS * STEPS, normalize_advantage=False)


def _rank(rank: int, port: int, policy, groups, shards: list, poisoned, out: str) -> None:
    """Rank ``rank``: one update on its shard, then one on a shard whose rank-1 copy has a NaN reward."""
    # torch.multiprocessing hands both ranks the parent's tensors in one shared memory: each needs its own copy
    learner = DataParallelRank(copy.deepcopy(policy), groups, ppo=PPO, lr=1e-3, batch_steps=1, seed=5, device="cpu")
    learner.join(rank, WORLD, "127.0.0.1", port)
    first = learner.train(to_wire(shards[rank]))
    trained = TensorDict.from_module(learner.learner.policy).detach().clone()
    params = [p.detach().clone() for p in learner.learner.policy.parameters()]
    in_sync = learner.in_sync()
    second = learner.train(to_wire(poisoned[rank]))
    torch.save({"first": first, "weights": trained.to_dict(), "in_sync": in_sync, "second": second,
                # parameters: a skipped step leaves them; the normalisers still merge the batch's observations
                "unchanged": all(torch.equal(a, b) for a, b in zip(params, learner.learner.policy.parameters())),
                "in_sync_after_skip": learner.in_sync()}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    # normalised observations: each rank sees half the batch, so its normalisers must merge the whole batch's
    # moments (summed over ranks) for the ranks to step as one learner
    config = TrainConfig(env="builtin:cartpole", seed=0, rollout=RolloutConfig(num_envs=ROWS, fragment_length=STEPS),
                         ppo=PPO, policy=PolicyConfig(normalize_observations=True))
    trainer = build_trainer(config)
    fragments = [trainer.fleet.actors[0].collect() for _ in range(WORLD)]
    policy = copy.deepcopy(trainer.learners["agent"].policy)
    groups = groups_of(assign(trainer.tree), "agent")
    shards = shard_by_rows(fragments, WORLD, "agent")
    poisoned = [s.clone() for s in shard_by_rows([trainer.fleet.actors[0].collect() for _ in range(WORLD)], WORLD,
                                                 "agent")]
    poisoned[1]["next", "agent", "reward"][3, 5] = float("nan")  # rank 1's loss and gradient become NaN
    reference = PPOLearner(copy.deepcopy(policy), groups, ppo=dataclasses.replace(PPO, minibatch_size=WORLD * ROWS
                                                                                   * STEPS), lr=1e-3, batch_steps=1,
                           seed=5)
    ref_metrics = reference.update_(fragments)
    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank, args=(free_port(), policy, groups, shards, poisoned, str(out)), nprocs=WORLD,
                       start_method="spawn")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"policy": policy, "reference": reference, "ref_metrics": ref_metrics, "ranks": ranks}


def test_two_ranks_on_halves_step_as_one_learner_on_the_whole_batch(outcome):
    ranks, reference = outcome["ranks"], outcome["reference"]
    assert all(r["in_sync"] for r in ranks)
    theirs = TensorDict.from_module(reference.policy)
    before = TensorDict.from_module(outcome["policy"])
    for rank in ranks:
        assert rank["first"]["skipped_steps"] == 0 and rank["first"]["num_minibatches"] == PPO.num_epochs
        weights = TensorDict(rank["weights"])
        assert not all(torch.equal(v, before.get(k)) for k, v in weights.items(True, True))  # it trained
        for key, value in weights.items(include_nested=True, leaves_only=True):
            torch.testing.assert_close(value, theirs.get(key), rtol=1e-5, atol=1e-6)
    # the pre-clip norm of the averaged gradient is the whole batch's
    assert ranks[0]["first"]["grad_norm"] == pytest.approx(outcome["ref_metrics"]["grad_norm"], rel=1e-4)


def test_a_non_finite_gradient_on_one_rank_makes_every_rank_skip_the_step(outcome):
    for rank in outcome["ranks"]:
        assert rank["second"]["skipped_steps"] == rank["second"]["num_minibatches"] == PPO.num_epochs
        assert rank["unchanged"] and rank["in_sync_after_skip"]
