"""Running observation normalisation as part of the policy's state: exact statistics, updated by learners,
sent to actors with the weights, kept in checkpoints, applied by exported programs."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from core.policies import PolicyConfig, make_policies
from core.policies.export import export_policy
from core.specs import AgentNode, ArrayPopulation, Leaf


def _policy():
    tree = ArrayPopulation(template=AgentNode(observation=Leaf.box((3,)), action=Leaf.discrete(2)), capacity=2)
    (policy,) = make_policies(tree, PolicyConfig(normalize_observations=True)).values()
    return policy


def test_running_statistics_equal_the_statistics_of_every_unmasked_row_seen():
    policy = _policy()
    g = torch.Generator().manual_seed(0)
    seen = []
    for scale in (1.0, 5.0, 0.1):
        obs = torch.randn(7, 4, 2, 3, generator=g) * scale + scale
        mask = torch.rand(7, 4, 2, generator=g) > 0.3
        policy.observe_(obs, mask)
        seen.append(obs[mask].double())
    allrows = torch.cat(seen)
    enc = policy.actor_encoder
    torch.testing.assert_close(enc.obs_mean0, allrows.mean(0))
    torch.testing.assert_close(enc.obs_var0, allrows.var(0, unbiased=False))
    assert int(enc.obs_count0) == allrows.shape[0]
    assert {"actor_encoder.obs_mean0", "actor_encoder.obs_var0"} <= set(policy.state_dict())  # checkpointed


def test_normalised_inputs_change_actions_and_exported_programs_apply_the_statistics():
    policy = _policy()
    obs = torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(1)) * 100 + 50
    before = policy.act_step({"observation": obs}, None, None, True, with_log_prob=False)["action_params"]
    policy.observe_(obs)
    after = policy.act_step({"observation": obs}, None, None, True, with_log_prob=False)["action_params"]
    assert not torch.allclose(before, after)  # the statistics are used
    program = export_policy(policy.eval(), TensorDict({"observation": obs}, batch_size=[6, 2]))
    expected = policy.act_step({"observation": obs}, None, None, True)["action"]
    assert torch.equal(program.module()(obs), expected)


def test_learners_update_the_statistics_and_actors_receive_them():
    from orchestration.builder import build_trainer
    from orchestration.config import RolloutConfig, TrainConfig

    trainer = build_trainer(TrainConfig(env="builtin:cartpole", iterations=2,
                                        policy=PolicyConfig(normalize_observations=True),
                                        rollout=RolloutConfig(num_envs=4, fragment_length=16)))
    trainer.train()
    learner = trainer.learners["agent"].policy.actor_encoder
    assert int(learner.obs_count0) == 4 * 16
    trainer.train()  # the actor loads the new weights, statistics included, before its next fragment
    actor = trainer.fleet.actors[0].policies["agent"].actor_encoder
    assert int(learner.obs_count0) == 2 * 4 * 16 and int(actor.obs_count0) == 4 * 16
    trainer.close()


def test_statistics_merged_from_sums_over_copies_equal_those_of_the_whole_batch():
    """Data-parallel ranks merge the moments of the whole batch from every rank's sums (``reduce``): two copies,
    each observing its half and adding the other half's sums (as an all-reduce would), end with the statistics
    of one policy that observed every row."""
    whole, halves = _policy(), [_policy(), _policy()]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        obs = torch.randn(8, 4, 2, 3, generator=g) * 3 + 1
        mask = torch.rand(8, 4, 2, generator=g) > 0.3
        whole.observe_(obs, mask)
        parts = [(obs[:4], mask[:4]), (obs[4:], mask[4:])]
        sums: dict[int, list] = {0: [], 1: []}
        for r, (o, m) in enumerate(parts):  # each copy's sums, recorded without merging anything
            _policy().observe_(o, m, reduce=lambda t, r=r: sums[r].append(t) or torch.zeros_like(t))
        for r, (policy, (o, m)) in enumerate(zip(halves, parts)):
            others = iter(sums[1 - r])
            policy.observe_(o, m, reduce=lambda t, others=others: t + next(others))
    for policy in halves:
        for name, value in whole.actor_encoder.state_dict().items():
            torch.testing.assert_close(policy.actor_encoder.state_dict()[name], value)
