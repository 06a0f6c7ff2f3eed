"""A learner's training batch: a group split between policies keeps its critic's inputs alike at every step."""

from __future__ import annotations

import pytest
import torch

from core.layout import CRITIC_MASK, DONE, MASK, NEXT, STATE_VALUE
from core.policies import PolicyConfig
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.train_batches import only_slots, with_values


@pytest.mark.parametrize("critic", ["central", "joint"])
def test_a_split_groups_critic_sees_the_same_agents_at_each_step_and_each_next_step(critic):
    """builtin:spread's agents_1 acts for policy "other": the default policy trains slots 0, 2 and 3 only, but its
    critic still reads every present agent, at the step (``CRITIC_MASK``) as at the next step. Where step t's next
    step is step t + 1 (same observations, presence and shared state), their values are then equal; with the
    narrowed mask at the step and the full one at the next step they differed by up to ~0.9."""
    config = TrainConfig(env="builtin:spread", seed=0, policy_mapping=(("agents_1", "other"),),
                         rollout=RolloutConfig(num_envs=8, fragment_length=16), policy=PolicyConfig(critic=critic))
    trainer = build_trainer(config)
    try:
        fragment = trainer.fleet.actors[0].collect()
        learner = trainer.trainable["agents"]
        slots = learner.groups["agents"]
        assert slots is not None and not bool(slots.all())  # the group is split
        batch = only_slots(fragment, "agents", slots)
        g = batch.get("agents")
        assert torch.equal(g.get(CRITIC_MASK), fragment.get(("agents", MASK)))
        assert torch.equal(g.get(MASK), fragment.get(("agents", MASK)) & slots)
        assert not torch.equal(g.get(MASK), g.get(CRITIC_MASK))  # other policies' agents are present
        with torch.no_grad():
            batch = with_values(learner.policy, batch, "agents")
        value, next_value = batch.get(("agents", STATE_VALUE)), batch.get((NEXT, "agents", STATE_VALUE))
        # env rows whose next step t is step t + 1 (no reset, no agent joining or leaving in between)
        same = ~batch.get((NEXT, DONE))[:, :-1, 0]
        for key in (("agents", "observation"), ("agents", MASK), ("shared",)):
            now, nxt = fragment.get(key)[:, 1:], fragment.get((NEXT, *key))[:, :-1]
            same &= (now == nxt).flatten(2).all(-1)
        assert int(same.sum()) > 50
        torch.testing.assert_close(next_value[:, :-1][same], value[:, 1:][same], rtol=0, atol=0)
    finally:
        trainer.close()
