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


def test_python_callers_mistakes_are_named_with_the_field_and_the_fix():
    """A misspelled backend would train locally unnoticed, and a dict for a nested config failed later with an
    AttributeError deep in the builder: both are refused at construction, naming the field."""
    import pytest

    with pytest.raises(ValueError, match=r"TrainConfig.backend must be 'local' or 'ray', got 'Ray' \(did you mean 'ray'"):
        TrainConfig(backend="Ray")
    with pytest.raises(TypeError, match=r"TrainConfig.rollout must be a RolloutConfig, got a dict \(write RolloutConfig"):
        TrainConfig(rollout={"num_envs": 4})
    with pytest.raises(TypeError, match=r"TrainConfig.ppo must be a PPOConfig"):
        TrainConfig(ppo={"num_epochs": 1})
    with pytest.raises(TypeError, match=r"TrainConfig.env_kwargs must be \(name, python literal\) pairs"):
        TrainConfig(env_kwargs=("ab",))
    import numpy as np

    config = TrainConfig(env="builtin:cartpole", env_kwargs={"max_steps": np.int64(50), "name": "'x'"})  # a dict
    assert config.env_kwargs == (("max_steps", "50"), ("name", "'x'"))
    with pytest.raises(TypeError, match=r"env_kwargs limit: inf has no Python literal form"):
        TrainConfig(env_kwargs={"limit": float("inf")})
    # pairs whose values a config file or an older checkpoint wrote as numbers still load, as literal text
    assert TrainConfig(env_kwargs=(("max_steps", 100),)).env_kwargs == (("max_steps", "100"),)
    assert load_config({"config": {**dataclasses.asdict(config), "env_kwargs": [["max_steps", 50], ["name", "'x'"]]}}
                       ) == config
    state = {"config": json.loads(json.dumps(dataclasses.asdict(config)))}
    assert load_config(state) == config
