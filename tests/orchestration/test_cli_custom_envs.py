"""A user's own env module from the command line: factories of each kind train; what is not an env, a file path
for a module, keywords no one takes, and env data that breaks its tree mid-run are each told in one paragraph."""

from __future__ import annotations

import pytest


CUSTOM_ENVS = '''
import gymnasium
from mpe2 import simple_spread_v3


def make_spread(max_cycles=10):
    return simple_spread_v3.parallel_env(max_cycles=max_cycles)


def make_spread_aec():
    return simple_spread_v3.env(max_cycles=10)


def make_cartpole():
    return gymnasium.make("CartPole-v1")


def make_nothing():
    return 42


class _Shorter(gymnasium.Wrapper):  # its steps (not its reset) drop the observation's last entry
    def step(self, action):
        obs, *rest = self.env.step(action)
        return (obs[:-1], *rest)


def make_wrong_shape():
    return _Shorter(gymnasium.make("CartPole-v1"))
'''


@pytest.mark.parametrize("factory, kind", [("make_spread", "PettingZooParallelEnv"),
                                           ("make_spread_aec", "PettingZooAECEnv"),
                                           ("make_cartpole", "GymnasiumVectorEnv")])
def test_a_custom_env_factory_trains_from_the_cli(tmp_path, monkeypatch, factory, kind):
    from orchestration.cli import main
    from orchestration.envs import make_env

    (tmp_path / "my_envs.py").write_text(CUSTOM_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert type(make_env(f"my_envs:{factory}", 2)).__name__ == kind
    main(["train", f"my_envs:{factory}", "--iterations", "1", "--rollout.num-envs", "2",
          "--rollout.fragment-length", "16", "--no-progress", "--run-dir", "run"])
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_adapter_keywords_given_to_a_gymnasium_factory_are_refused_not_dropped(tmp_path, monkeypatch):
    from orchestration.envs import make_env

    # a module name of its own: other tests import my_envs (sys.modules keeps the first one)
    (tmp_path / "keyword_envs.py").write_text(CUSTOM_ENVS + "\n\ndef make_stateful(state=1):\n    assert state == 7\n"
                                              "    return gymnasium.make('CartPole-v1')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="--env-kwargs payoff configure the PettingZoo adapter, and this factory "
                                         "returns a gymnasium env"):
        make_env("keyword_envs:make_cartpole", 2, kwargs={"payoff": "zero_sum"})
    assert make_env("keyword_envs:make_cartpole", 2, kwargs={"action_mask": "none"}).num_envs == 2  # its masks
    assert make_env("keyword_envs:make_stateful", 2, kwargs={"state": 7}).num_envs == 2  # the factory's own


TEXT_ENVS = """
import gymnasium


class TextEnv(gymnasium.Env):  # an observation space Shoal has no tensor layout for
    observation_space = gymnasium.spaces.Text(5)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, length=5):
        self.length = length


def make_text(length=5):
    return TextEnv(length)
"""


def test_a_space_shoal_cannot_lay_out_names_the_env_not_its_keywords(tmp_path, monkeypatch, capsys):
    """Shoal's own refusal while building (the adapter's) names the env; its --env-kwargs are not blamed."""
    from orchestration.cli import main

    (tmp_path / "text_envs.py").write_text(TEXT_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for kwargs in ([], ["--env-kwargs", "length", "3"]):
        with pytest.raises(SystemExit):
            main(["train", "text_envs:make_text", *kwargs, "--no-progress"])
        err = capsys.readouterr().err
        assert err.startswith("shoal train: env 'text_envs:make_text': agent/observation: unsupported gymnasium "
                              "space Text") and "failed to build" not in err, err


def test_a_factory_returning_something_else_is_named(tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    (tmp_path / "my_envs.py").write_text(CUSTOM_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["train", "my_envs:make_nothing", "--no-progress"])
    assert "returned int" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a misspelled factory: gymnasium would only say its id does not exist
        main(["train", "my_envs:make_nothng", "--no-progress"])
    assert "module my_envs has no factory 'make_nothng' (did you mean 'make_nothing'?)" in capsys.readouterr().err


def test_env_data_that_breaks_the_tree_mid_run_and_an_env_given_as_a_path_are_told_in_one_paragraph(
        tmp_path, monkeypatch, capsys):
    from orchestration.cli import main

    (tmp_path / "my_envs.py").write_text(CUSTOM_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:  # found at the first step, once training runs: not a traceback
        main(["train", "my_envs:make_wrong_shape", "--iterations", "1", "--rollout.num-envs", "2", "--no-progress",
              "--ppo.minibatch-size", "64", "--run-dir", "run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip() == ("shoal train: env 0, agent 'agent', key next/agent/observation: "
                                                     "expected shape (4,), got (3,)"), err
    with pytest.raises(SystemExit) as exit_:  # the same, found in an env process
        main(["train", "my_envs:make_wrong_shape", "--iterations", "1", "--rollout.num-envs", "2", "--no-progress",
              "--rollout.env-processes", "2", "--run-dir", "run2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "raised adapters.checking.EnvOutputError: env 0, agent 'agent', key " \
        "next/agent/observation: expected shape (4,), got (3,). Strict mode stops here" in err and "Traceback" not in err
    for path in ("./my_envs.py", ".my_envs"):
        with pytest.raises(SystemExit) as exit_:
            main(["train", f"{path}:make_cartpole", "--no-progress"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "not a file path or a relative import: --env my_envs:make_cartpole" in err


@pytest.mark.ray
@pytest.mark.parametrize("processes", [0, 2], ids=["in_worker", "env_processes"])
def test_env_data_that_breaks_the_tree_in_a_ray_worker_is_the_same_error_as_locally(ray_session, processes):
    """On Ray the error reaches the driver as itself (the CLI's one paragraph, exit 2), not as a worker death that
    is restarted until the restarts run out (a traceback after 100 new workers failed alike)."""
    from adapters.checking import EnvOutputError
    from adapters.env_process import EnvWorkerFault
    from orchestration.builder import build_trainer
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig
    from orchestration.user_errors import is_users_mistake

    config = TrainConfig(env="tests.orchestration.faulty_env_factories:make_wrong_shape", backend="ray",
                         iterations=1, rollout=RolloutConfig(num_envs=2, fragment_length=8, env_processes=processes),
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0, max_worker_restarts=1))
    trainer = build_trainer(config)
    try:
        with pytest.raises((EnvOutputError, EnvWorkerFault)) as raised:
            trainer.train()
        assert is_users_mistake(raised.value) and trainer.fleet.restarts == 0
        assert "env 0, agent 'agent', key next/agent/observation: expected shape (4,), got (3,)" in str(raised.value)
    finally:
        trainer.close()


@pytest.mark.ray
@pytest.mark.parametrize("factory", ["make_out_of_bounds", "make_raising"])
def test_an_env_that_fails_in_a_ray_worker_ends_the_run_as_locally(ray_session, factory):
    """An env whose first observation is out of its space (found while the worker is built) and an env whose code
    raises: the Ray run ends with the local run's error, as itself, and no worker is re-created (Ray kept only
    the first one's text; the second was re-created until the restarts ran out)."""
    import dataclasses

    from orchestration.builder import build_trainer
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig

    config = TrainConfig(env=f"tests.orchestration.faulty_env_factories:{factory}", iterations=1,
                         rollout=RolloutConfig(num_envs=2, fragment_length=8),
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0, max_worker_restarts=1))

    def failure(backend: str) -> tuple[Exception, int]:
        trainer = None
        try:
            trainer = build_trainer(dataclasses.replace(config, backend=backend))
            trainer.train()
        except Exception as err:
            return err, getattr(trainer.fleet, "restarts", 0) if trainer is not None else 0
        finally:
            if trainer is not None:
                trainer.close()
        pytest.fail(f"{backend}: the env's fault went unnoticed")

    (local, _), (remote, restarts) = failure("local"), failure("ray")
    assert isinstance(remote, type(local)) and restarts == 0
    assert str(local) in str(remote), (local, remote)
