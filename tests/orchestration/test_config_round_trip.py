"""A run's config survives a checkpoint: written as JSON, read back by ``load_config`` equal to the original."""

from __future__ import annotations

import dataclasses
import json

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.run_state import load_config


def test_every_nested_tuple_field_survives_json():
    config = TrainConfig(env="builtin:recall", env_kwargs=(("num_cues", "4"),), iterations=3,
                         rollout=RolloutConfig(num_envs=4, fragment_length=8),
                         ppo=PPOConfig(sequence_length=4, burn_in=2),
                         policy=PolicyConfig(hidden_sizes=(8, 8), recurrent=True, recurrent_cell="lstm",
                                             recurrent_critic=True, leaf_encoders=(("observation", "flatten"),)),
                         policy_mapping=(("agent", "main"),))
    state = {"config": json.loads(json.dumps(dataclasses.asdict(config)))}
    assert load_config(state) == config
