"""A config built from Python with a value of the wrong kind is named at once (``orchestration.config_kinds``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.config import (CuriosityConfig, PastSelvesConfig, PretrainConfig, RayConfig, RolloutConfig,
                                  TrainConfig)
from orchestration.config_kinds import field_hints
from orchestration.external_config import ExternalConfig
from orchestration.inference_requests import InferenceConfig
from orchestration.league_config import LeagueConfig
from orchestration.team_critic_config import TeamCriticConfig

CONFIGS = (TrainConfig, RolloutConfig, RayConfig, PretrainConfig, CuriosityConfig, PastSelvesConfig, ExternalConfig,
           InferenceConfig, LeagueConfig, TeamCriticConfig, PPOConfig, PolicyConfig)


@pytest.mark.parametrize("kind", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_annotation_resolves(kind):
    """An annotation that does not resolve would make the check pass everything in silence."""
    assert set(field_hints(kind)) == {f.name for f in dataclasses.fields(kind)}


@pytest.mark.parametrize("build, message", [
    # each of these was taken before, or failed later in a comparison that named no field
    (lambda: TrainConfig(iterations="10"), r"TrainConfig\.iterations takes an int, got '10' \(a str\)"),
    (lambda: TrainConfig(anneal_lr="no"), r"TrainConfig\.anneal_lr takes a bool, got 'no'"),  # was truthy
    (lambda: TrainConfig(seed=1.5), r"TrainConfig\.seed takes an int, got 1\.5 \(a float\)"),
    (lambda: TrainConfig(seed=True), r"TrainConfig\.seed takes an int, got True \(a bool\)"),
    (lambda: TrainConfig(lr="3e-4"), r"TrainConfig\.lr takes a float, got '3e-4'"),
    (lambda: TrainConfig(fixed_policies="blue"), r"TrainConfig\.fixed_policies takes a tuple, got 'blue'"),
    (lambda: TrainConfig(eval_every=None), r"TrainConfig\.eval_every takes an int, got None$"),
    (lambda: TrainConfig(ppo=PPOConfig(normalize_advantage="x")), r"PPOConfig\.normalize_advantage takes a bool"),
    (lambda: RolloutConfig(num_envs="8"), r"RolloutConfig\.num_envs takes an int, got '8'"),
    (lambda: RayConfig(num_cpus="2"), r"RayConfig\.num_cpus takes a float or None, got '2'"),
    (lambda: ExternalConfig(port="8080"), r"ExternalConfig\.port takes an int"),
    (lambda: InferenceConfig(device=0), r"InferenceConfig\.device takes a str, got 0 \(an int\)"),
    (lambda: CuriosityConfig(coef="0.1"), r"CuriosityConfig\.coef takes a float"),
    (lambda: TrainConfig(policy_mapping=("player_1", "random")),  # a flat pair: was dict()'s "element #0" error
     r"TrainConfig\.policy_mapping takes \(name, value\) pairs"),
])
def test_a_value_of_another_kind_names_its_field(build, message):
    with pytest.raises(TypeError, match=message):
        build()


@pytest.mark.parametrize("build, message", [
    (lambda: TrainConfig(backend="Ray"), r"TrainConfig\.backend must be 'local' or 'ray', got 'Ray' \(did you mean "
                                         r"'ray'\?\)"),
    (lambda: TrainConfig(mode="Async"), r"TrainConfig\.mode must be 'sync' or 'async', got 'Async' \(did you mean "
                                        r"'async'\?\)"),
    (lambda: RolloutConfig(check="lenien"), r"RolloutConfig\.check must be 'strict' or 'lenient', got 'lenien' "
                                            r"\(did you mean 'lenient'\?\)"),  # was taken, and ran strict
])
def test_a_misspelt_choice_names_the_nearest(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_lists_and_dicts_become_the_tuples_a_config_file_gives():
    given = TrainConfig(policy_mapping={"agents_0": "a", "agents_1": "b"}, fixed_policies=["b"],
                        loggers=["csv"], ray=RayConfig(learner_resources=[["accelerator", 1.0]]))
    written = TrainConfig(policy_mapping=(("agents_0", "a"), ("agents_1", "b")), fixed_policies=("b",),
                          loggers=("csv",), ray=RayConfig(learner_resources=(("accelerator", 1.0),)))
    assert given == written and hash(given) == hash(written)
    assert TrainConfig(loggers="csv").loggers == ("csv",)


def test_numbers_of_numpy_and_of_other_kinds_pass():
    """A Tune search space gives numpy numbers; an int is a float."""
    config = TrainConfig(lr=np.float32(1e-3), seed=np.int64(3), iterations=2, anneal_lr=np.bool_(False),
                         ray=RayConfig(num_cpus=2, learner_num_gpus="auto"))
    assert config.seed == 3 and config.ray.num_cpus == 2 and config.anneal_lr is False
    assert (type(config.seed), type(config.lr)) == (int, float)  # Python's own: a checkpoint's JSON keeps them


def test_a_path_or_a_torch_device_given_for_a_name_is_its_text(tmp_path):
    import torch

    config = TrainConfig(run_dir=tmp_path / "run", device=torch.device("cpu"))
    assert (config.run_dir, config.device) == (str(tmp_path / "run"), "cpu")
