"""Presets: tuned configs shipped in ``orchestration/presets`` (``shoal train --preset NAME``)."""

from __future__ import annotations

import pytest

from orchestration.config import TrainConfig
from orchestration.presets import load_preset, preset_names


def test_every_preset_loads_into_a_valid_train_config():
    names = preset_names()
    assert {"cartpole", "acrobot", "pendulum", "lunarlander", "spread_ippo", "spread_mappo", "navigation",
            "connect_four", "recall", "spot"} <= set(names)
    for name in names:
        config = load_preset(name)
        assert isinstance(config, TrainConfig) and config.iterations > 0, name
        assert config != TrainConfig(), f"preset {name} changes nothing"
    assert load_preset("spread_mappo").policy.critic == "central" and load_preset("spread_ippo").policy.critic == "local"
    recall = load_preset("recall")
    assert recall.policy.recurrent and recall.policy.recurrent_critic and recall.env_kwargs[0] == ("num_cues", "4")


def test_the_cartpole_preset_keeps_the_settings_the_readme_job_was_measured_with():
    config = load_preset("cartpole")
    assert (config.env, config.lr, config.iterations, config.ppo.entropy_coef) == ("CartPole-v1", 2.5e-3, 100, 0.0)
    assert (config.rollout.num_envs, config.rollout.fragment_length, config.ppo.minibatch_size) == (16, 64, 256)


def test_an_unknown_preset_is_one_paragraph_naming_the_valid_ones_and_the_nearest(capsys):
    from orchestration.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--preset", "pendulm", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unknown preset 'pendulm' (did you mean 'pendulum'?)" in err and "cartpole" in err and "\n" not in err


def test_flags_override_a_preset_and_a_config_file_goes_over_it(tmp_path, monkeypatch):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("rollout: {num_envs: 4, fragment_length: 16}\n")
    main(["train", "--preset", "cartpole", "--config-file", "run.yaml", "--iterations", "1", "--env",
          "builtin:cartpole", "--run-dir", "r", "--loggers", "csv", "--no-progress"])
    from orchestration.checkpoint import load_checkpoint
    from orchestration.run_state import load_config

    config = load_config(load_checkpoint(tmp_path / "r" / "checkpoints")[2])
    assert (config.env, config.iterations, config.lr, config.ppo.entropy_coef) == ("builtin:cartpole", 1, 2.5e-3, 0.0)
    assert (config.rollout.num_envs, config.rollout.fragment_length) == (4, 16)


def test_help_lists_the_presets(capsys):
    from orchestration.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in preset_names())


@pytest.mark.parametrize("text, named", [
    ("iterations: [2", "is not valid YAML"),
    ("iterations: two", "key 'iterations' takes a whole number, got 'two'"),
    ("lr: fast", "key 'lr' takes a number, got 'fast'"),
    ("rollout: 4", "key 'rollout' takes a section"),
    ("rollout: {num_envs: 4.5}", "key 'rollout.num_envs' takes a whole number, got 4.5"),
    ("env: 5", "key 'env' takes a string, got 5"),
    ("backend: rai", "key 'backend' takes one of 'local', 'ray', got 'rai'"),
    ("ppo: {normalize_advantage: 1}", "key 'ppo.normalize_advantage' takes true or false, got 1"),
    ("run_dir: null", "key 'run_dir' takes a string, got None"),
    ("env_kwargs: [max_steps, 10]", "TrainConfig.env_kwargs must be (name, python literal) pairs"),  # a traceback
])
def test_a_config_file_value_of_the_wrong_kind_is_refused_naming_the_file_and_key(tmp_path, text, named):
    from orchestration.presets import config_from_file

    (tmp_path / "run.yaml").write_text(text + "\n")
    with pytest.raises(ValueError, match="config file .*run.yaml") as error:
        config_from_file(str(tmp_path / "run.yaml"))
    assert named in str(error.value)


def test_a_config_file_takes_what_its_fields_allow(tmp_path):
    from orchestration.presets import config_from_file

    (tmp_path / "run.yaml").write_text("lr: 1\nppo: {clip_eps: 1e-1, value_clip_eps: null}\nray: {learner_num_gpus: 0.5}\n"
                                       "policy: {hidden_sizes: [32, 32]}\n")
    config = config_from_file(str(tmp_path / "run.yaml"))
    assert (config.lr, config.ppo.clip_eps, config.ray.learner_num_gpus, config.policy.hidden_sizes) == \
        (1.0, 0.1, 0.5, (32, 32)) and isinstance(config.lr, float)
    # env keywords as a mapping, as TrainConfig takes them from Python (was refused: "takes a list")
    (tmp_path / "kw.yaml").write_text("env_kwargs: {max_steps: 50, sutton_barto_reward: true}\n")
    assert config_from_file(str(tmp_path / "kw.yaml")).env_kwargs == (("max_steps", "50"),
                                                                        ("sutton_barto_reward", "True"))


def test_an_env_factory_from_the_running_script_is_refused_on_ray_and_a_function_is_told_its_name_form():
    """``__main__:factory`` trained locally and failed on Ray with a worker's traceback (workers cannot import the
    script); a function given itself was told only "takes a str"."""
    def make_bandit():
        pass

    with pytest.raises(TypeError, match=r"name a factory as 'module:function' \(e.g. '.*:make_bandit'\)"):
        TrainConfig(env=make_bandit)
    with pytest.raises(ValueError, match=r"cannot import the script you run \(__main__\); move the factory into a "
                                         r"module beside it \(my_envs.py: --env my_envs:make_bandit\)"):
        TrainConfig(env="__main__:make_bandit", backend="ray")
    assert TrainConfig(env="__main__:make_bandit").env == "__main__:make_bandit"  # one process: fine
