"""The RND curiosity bonus in the learner (orchestration/curiosity.py): it reaches the reward PPO trains on, it
fades on familiar observations, its state round-trips bit for bit, and ``shoal train`` runs it on both backends."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tensordict import TensorDict

from core.layout import MASK, NEXT, OBSERVATION, REWARD
from core.specs import Leaf
from orchestration.config import CuriosityConfig, RayConfig, RolloutConfig, TrainConfig
from orchestration.curiosity import Curiosity

ENV = "builtin:cartpole"
ON = CuriosityConfig(coef=0.5)  # trains on a random quarter of the samples: the generator matters


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"env": ENV, "iterations": 1, "rollout": RolloutConfig(num_envs=4, fragment_length=32),
                          "loggers": (), **kw})


def _learner_and_fragments(curiosity: CuriosityConfig, n: int = 1):
    """A learner built by the builder (coef as given) and ``n`` fragments ``[4, 32]`` of the run's env."""
    from orchestration.builder import build_trainer

    trainer = build_trainer(_config(curiosity=curiosity))
    fragments = [trainer.fleet.actors[0].collect() for _ in range(n)]
    (pid, learner), = trainer.trainable.items()
    return learner, fragments


def _trained_on(learner, fragment, monkeypatch) -> TensorDict:
    """The ``("next", group)`` rewards and the advantages of one update of ``learner`` on ``fragment``."""
    import orchestration.train_batches as module  # where the learner's GAE is called (with_advantages)

    seen = {}
    real = module.with_gae

    def spy(batch, group, *args, **kwargs):
        out = real(batch, group, *args, **kwargs)
        seen["reward"] = batch.get((NEXT, group, REWARD)).clone()
        seen["advantage"] = out.get((group, "advantage")).clone()
        return out

    monkeypatch.setattr(module, "with_gae", spy)
    metrics = learner.update_([fragment])
    return TensorDict(seen), metrics


def test_the_bonus_changes_the_reward_and_advantages_the_learner_trains_on(monkeypatch):
    on, (fragment,) = _learner_and_fragments(ON)
    off = copy.deepcopy(on)
    off.curiosity = None  # the same learner, weights and generator, without the bonus
    with_bonus, metrics = _trained_on(on, fragment, monkeypatch)
    without, metrics_off = _trained_on(off, fragment, monkeypatch)
    env_reward = fragment.get((NEXT, "agent", REWARD))
    assert torch.equal(without["reward"], env_reward)  # coef 0: exactly the env's reward
    bonus = with_bonus["reward"] - env_reward
    assert bool((bonus >= 0).all()) and float(bonus.min()) > 0  # every present step gets a positive bonus
    assert not torch.allclose(with_bonus["advantage"], without["advantage"])
    mean_bonus = metrics["curiosity/intrinsic_reward"]
    torch.testing.assert_close(float(bonus.mean()), ON.coef * mean_bonus, rtol=1e-4, atol=1e-6)
    assert "curiosity/predictor_loss" in metrics and not any(k.startswith("curiosity/") for k in metrics_off)


def test_off_by_default_builds_no_networks():
    learner, _ = _learner_and_fragments(CuriosityConfig())
    assert learner.curiosity is None and "curiosity" not in learner.state()


def _batch(obs: torch.Tensor, mask: torch.Tensor | None = None) -> TensorDict:
    """A ``[E, T]`` batch of one group with next observations ``obs`` ``[E, T, A, D]`` and zero rewards."""
    e, t, a = obs.shape[:3]
    nxt = TensorDict(agent=TensorDict({OBSERVATION: obs, REWARD: torch.zeros(e, t, a, 1)}, batch_size=[e, t, a]),
                     batch_size=[e, t])
    group = TensorDict({} if mask is None else {MASK: mask}, batch_size=[e, t, a])
    return TensorDict({NEXT: nxt, "agent": group}, batch_size=[e, t])


def _curiosity(**kw) -> Curiosity:
    config = CuriosityConfig(**{"coef": 1.0, "lr": 3e-3, "proportion": 1.0, **kw})
    return Curiosity(config, [()], [Leaf.box((4,))], groups=["agent"], name="group agent", seed=3)


def test_the_error_on_a_repeated_observation_falls_as_the_predictor_trains():
    rnd = _curiosity()
    familiar = torch.randn(8, 16, 1, 4, generator=torch.Generator().manual_seed(0))
    novel = familiar + 4.0
    rewards, errors = [], []
    for _ in range(60):
        metrics: dict[str, float] = {}
        batch = rnd.add_bonus_(_batch(familiar), "agent", None, metrics)
        rewards.append(float(batch.get((NEXT, "agent", REWARD)).mean()))
        errors.append(metrics["curiosity/prediction_error"])
    assert errors[-1] < 0.2 * errors[0] and rewards[-1] < 0.5 * rewards[0]
    assert float(rnd.error(novel).mean()) > 5 * float(rnd.error(familiar).mean())


def test_absent_agents_get_no_bonus_and_do_not_train_the_predictor():
    obs = torch.randn(2, 4, 2, 4, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 4, 2, dtype=torch.bool)
    mask[..., 0] = True
    a, b = _curiosity(), _curiosity()
    out = a.add_bonus_(_batch(obs, mask), "agent", None, {})
    reward = out.get((NEXT, "agent", REWARD))
    assert bool((reward[..., 1, :] == 0).all()) and bool((reward[..., 0, :] > 0).all())
    garbage = obs.clone()
    garbage[..., 1, :] = 1e6  # what absent agents observe must not matter
    b.add_bonus_(_batch(garbage, mask), "agent", None, {})
    assert all(torch.equal(x, y) for x, y in zip(a.state().values(), b.state().values()))


def test_a_non_vector_observation_is_refused_by_name():
    with pytest.raises(ValueError, match=r"group pixels: observation/camera .*vector observations only"):
        Curiosity(ON, [("camera",)], [Leaf.box((3, 8, 8))], groups=["pixels"], name="group pixels")


def test_state_round_trips_bit_for_bit_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file, save_file

    learner, (first, second) = _learner_and_fragments(ON, n=2)
    fresh = copy.deepcopy(learner)  # same config and structure, untrained
    learner.update_([first])
    path = tmp_path / "curiosity.safetensors"
    save_file(learner.curiosity.state(), str(path))  # tensors only: safetensors takes it as it is
    state = learner.state()
    state["curiosity"] = load_file(str(path))
    fresh.load_state_(state)
    assert all(torch.equal(v, fresh.curiosity.state()[k]) for k, v in learner.curiosity.state().items())
    a, b = learner.update_([second]), fresh.update_([second])
    assert a == b  # same bonus, same predictor step (same sample draws), same PPO update
    assert all(torch.equal(v, fresh.curiosity.state()[k]) for k, v in learner.curiosity.state().items())
    assert all(torch.equal(v, fresh.policy.state_dict()[k]) for k, v in learner.policy.state_dict().items())


def test_checkpoints_keep_the_curiosity_state_and_old_configs_load_without_it(tmp_path):
    from orchestration.builder import build_trainer
    from orchestration.run_state import config_to_dict, load_config, restore_trainer_, trainer_state

    config = _config(curiosity=ON)
    trainer = build_trainer(config)
    trainer.train()
    weights, tensors, state = trainer_state(trainer)
    assert any(k.startswith("curiosity/") for k in tensors)
    resumed = build_trainer(load_config(state))
    assert resumed.config.curiosity == ON
    restore_trainer_(resumed, weights, tensors, state)
    (pid, before), = trainer.trainable.items()
    after = resumed.trainable[pid]
    assert all(torch.equal(v, after.curiosity.state()[k]) for k, v in before.curiosity.state().items())
    old = {**state, "config": {k: v for k, v in config_to_dict(config).items() if k != "curiosity"}}
    assert load_config(old).curiosity == CuriosityConfig()  # a checkpoint from before the field: bonus off


def _cli_run(tmp_path, *extra: str) -> dict:
    from orchestration.cli import train

    return train([ENV, "--iterations", "2", "--rollout.num-envs", "4", "--rollout.fragment-length", "32",
                  "--curiosity.coef", "0.5", "--loggers", "csv", "--no-progress", "--run-dir", str(tmp_path / "run"),
                  *extra])


def test_shoal_train_with_curiosity_on_the_local_backend(tmp_path):
    from safetensors import safe_open

    metrics = _cli_run(tmp_path)
    assert metrics["curiosity/intrinsic_reward"] > 0 and metrics["curiosity/predictor_loss"] > 0
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    assert "curiosity/intrinsic_reward" in header
    files = sorted((tmp_path / "run" / "checkpoints").rglob("*.safetensors"))
    keys = set().union(*(set(safe_open(str(f), "pt").keys()) for f in files))
    assert any(k.startswith("curiosity/") and k.endswith("predictor/0.weight") for k in keys), sorted(keys)[:20]


@pytest.mark.ray
def test_shoal_train_with_curiosity_on_the_ray_backend(tmp_path, ray_session, capsys):
    metrics = _cli_run(tmp_path, "--backend", "ray", "--ray.worker-num-cpus", "0", "--ray.learner-num-cpus", "0")
    assert metrics["curiosity/intrinsic_reward"] > 0 and metrics["curiosity/predictor_loss"] > 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 and '"run_dir"' in out  # stdout: the result alone, as locally
    assert "iteration 2: {" in err  # the fleet's health every iteration goes to stderr


def test_curiosity_and_data_parallel_learners_are_refused_in_one_message():
    with pytest.raises(ValueError, match="learners_per_policy"):
        dataclasses.replace(_config(curiosity=ON), ray=RayConfig(learners_per_policy=2))


@pytest.mark.parametrize("field, value, rule", [("coef", -1.0, ">= 0"), ("epochs", 0, ">= 1"),
                                                ("proportion", 1.5, "in (0, 1]")])
def test_a_curiosity_setting_out_of_range_is_named_alone(field, value, rule):
    """The message named every field and listed every value, so the one at fault had to be found by eye."""
    with pytest.raises(ValueError) as error:
        CuriosityConfig(**{field: value})
    assert str(error.value) == f"CuriosityConfig.{field} must be {rule}, got {value!r}"
    with pytest.raises(ValueError, match=r"^RolloutConfig.env_processes must be >= 0, got -1$"):
        RolloutConfig(env_processes=-1)
