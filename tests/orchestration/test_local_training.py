"""The local backend end to end: learning by step budget and seed, resume, NaN guard, export."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from tensordict import TensorDict

from core.losses import PPOConfig
from core.policies import deployable, deployment_inputs, export_policy
from core.specs import rand
from orchestration.checkpoint import load_checkpoint, save_checkpoint
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.run_state import restore_trainer_, trainer_state
from orchestration.builder import build_trainer

FAST = TrainConfig(env="CartPole-v1", seed=1, lr=1e-3, iterations=6,
                   rollout=RolloutConfig(num_envs=8, fragment_length=64),
                   ppo=PPOConfig(minibatch_size=128, num_epochs=4))


def _run(config: TrainConfig, iterations: int) -> list[dict]:
    trainer = build_trainer(config)
    return [trainer.train() for _ in range(iterations)], trainer


@pytest.mark.slow
def test_cartpole_reaches_195_within_a_step_budget():
    config = dataclasses.replace(FAST, iterations=60, lr=2.5e-3, anneal_lr=True,
                                 rollout=RolloutConfig(num_envs=16, fragment_length=64),
                                 ppo=PPOConfig(minibatch_size=256, num_epochs=4))
    trainer = build_trainer(config)
    best = 0.0
    for _ in range(config.iterations):  # budget: 60 x 1024 = 61,440 env steps
        m = trainer.train()
        best = max(best, m["episode_return_mean_10"])
        if best >= 195:
            break
    assert best >= 195, f"mean return of the last 10 episodes peaked at {best:.1f} after {trainer.env_steps} steps"


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    config = dataclasses.replace(FAST, env="builtin:cartpole")
    straight, straight_trainer = _run(config, 4)
    first, trainer = _run(config, 2)
    weights, tensors, state = trainer_state(trainer)
    save_checkpoint(tmp_path, trainer.iteration, weights=weights, tensors=tensors, state=state)
    del trainer
    resumed = build_trainer(config)  # a fresh trainer, as after a restart
    restore_trainer_(resumed, *load_checkpoint(tmp_path))
    assert load_checkpoint(tmp_path)[2]["resume_exact"]
    second = [resumed.train() for _ in range(2)]
    for a, b in zip(straight, first + second):
        for key in ("loss_policy", "loss_value", "approx_kl", "episode_return_mean", "env_steps"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7, nan_ok=True), key
    for pid, learner in straight_trainer.learners.items():
        theirs = resumed.learners[pid].policy.state_dict()
        for name, value in learner.policy.state_dict().items():
            torch.testing.assert_close(value, theirs[name], msg=name)


def test_a_nan_in_the_loss_leaves_weights_unchanged_and_is_reported():
    trainer = build_trainer(FAST)
    trainer.train()
    learner = trainer.learners["agent"]
    before = TensorDict.from_module(learner.policy).clone()
    adam_before = {k: v.clone() for k, v in learner.optimizer.state[next(iter(learner.optimizer.state))].items()}
    original = learner.policy.evaluate_terms  # what the learner calls per minibatch

    def poisoned(batch, shared=None):
        out = original(batch, shared)
        out["log_prob"] = out["log_prob"] * float("nan")
        return out

    learner.policy.evaluate_terms = poisoned
    metrics = trainer.train()
    assert metrics["skipped_steps"] == metrics["num_minibatches"] > 0
    assert (TensorDict.from_module(learner.policy) == before).all()
    after = learner.optimizer.state[next(iter(learner.optimizer.state))]
    for k, v in adam_before.items():
        torch.testing.assert_close(after[k], v)
    assert learner.counters["skipped_steps"] == metrics["skipped_steps"]


def test_exported_policy_acts_like_the_training_policy_in_deterministic_mode():
    trainer = build_trainer(FAST)
    trainer.train()
    policy = trainer.learners["agent"].policy
    obs = rand(trainer.tree, (7,), torch.Generator().manual_seed(3)).get("agent")
    buffer = io.BytesIO()
    torch.export.save(export_policy(policy, obs), buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    args, kwargs = deployment_inputs(policy, obs)
    expected = policy.act(obs, deterministic=True).get("action")
    torch.testing.assert_close(loaded(*args, **kwargs), expected)
    torch.testing.assert_close(deployable(policy)(*args, **kwargs), expected)


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_valid(tmp_path, monkeypatch):
    import orchestration.checkpoint as ckpt

    trainer = build_trainer(FAST)
    trainer.train()
    save_checkpoint(tmp_path, 1, **dict(zip(("weights", "tensors", "state"), trainer_state(trainer))))
    trainer.train()
    weights, tensors, state = trainer_state(trainer)
    calls = []

    def crash_on_second_file(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")  # the weights are written, the state file is not
        return real_save(tensors, path)

    real_save = ckpt.save_file
    monkeypatch.setattr(ckpt, "save_file", crash_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, weights=weights, tensors=tensors, state=state)
    monkeypatch.undo()
    _, _, restored = load_checkpoint(tmp_path)
    assert restored["iteration"] == 1  # `latest` still names the complete first checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "latest"]  # no half-written leftovers


def test_values_of_a_large_batch_are_computed_in_chunks_with_the_same_result(monkeypatch):
    """The learner evaluates the critic over a big batch in chunks of env rows (bounded activations): an
    update with 3-row chunks trains the same weights as one critic call over the batch (up to float
    rounding)."""
    import orchestration.train_batches as batches_module

    config = TrainConfig(env="builtin:cartpole", seed=2, rollout=RolloutConfig(num_envs=8, fragment_length=16))
    weights = []
    for chunk in (1 << 16, 3 * 16):  # one call; then chunks of 3 env rows of 16 steps (the last one 2 rows)
        monkeypatch.setattr(batches_module, "VALUE_CHUNK", chunk)
        trainer = build_trainer(config)
        trainer.train()
        weights.append(trainer.learners["agent"].weights()[1])
        trainer.close()
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0].keys(True, True))


def test_async_iteration_timeout_counts_only_time_without_data(monkeypatch):
    """A batch larger than what arrives within ``--ray.iteration-timeout-s`` fills while fragments keep coming (it
    failed: the timer ran from the last training step); a run where nothing arrives stops with the user-facing
    StalledRun naming the flag and the batch in hand, not a bare TimeoutError. A learner slower to answer than the
    timeout is not a stall either: the time is counted from after the fleet's pump (it failed on a loaded CI
    machine, timed from before the first pump)."""
    import time

    from orchestration.config import RayConfig
    from orchestration.user_errors import StalledRun, is_users_mistake

    config = TrainConfig(env="builtin:cartpole", seed=0, mode="async", train_batch_size=2048,
                         rollout=RolloutConfig(num_envs=8, fragment_length=16), ray=RayConfig(iteration_timeout_s=1e-4))
    trainer = build_trainer(config)
    learner, submit = trainer.trainable["agent"], trainer.trainable["agent"].submit
    monkeypatch.setattr(learner, "submit", lambda *args, **kwargs: time.sleep(1e-3) or submit(*args, **kwargs))
    assert trainer.train()["env_steps_trained"] == 2048  # 16 rounds of fragments, each well over the timeout
    monkeypatch.setattr(trainer.fleet, "pump", lambda weights=None, hungry=False: None)  # nothing arrives any more
    with pytest.raises(StalledRun) as stalled:
        trainer.train()
    assert is_users_mistake(stalled.value)
    assert "no fragment arrived for 0.0001 s (--ray.iteration-timeout-s), with 0 of the 2048 env steps" in \
        str(stalled.value)
    trainer.close()


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_restored_evaluator_plays_the_restored_weights_and_a_new_eval_episodes_resumes(backend, request):
    """The evaluator's checkpointed state held the version it had loaded, not the weights: evaluating a restored
    trainer played freshly initialised ones. A resume with another --eval-episodes (other eval envs) was refused.
    The evaluator lives in the driver on either backend."""
    from orchestration.config import RayConfig
    from orchestration.run_state import load_config

    if backend == "ray":
        request.getfixturevalue("ray_session")
    config = TrainConfig(env="builtin:cartpole", iterations=3, eval_every=1, eval_episodes=2, backend=backend,
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0),
                         rollout=RolloutConfig(num_envs=4, fragment_length=16))
    trainer = build_trainer(config)
    trainer.train()
    parts = trainer_state(trainer)
    trainer.close()
    for eval_episodes in (2, 3):
        again = build_trainer(dataclasses.replace(load_config(parts[2]), eval_episodes=eval_episodes), pretrain=False)
        try:
            restore_trainer_(again, *parts)
            again.evaluate(2)
            for pid, learner in again.learners.items():
                acting = TensorDict.from_module(again.evaluator.policies[pid])
                assert (acting == learner.weights()[1]).all(), eval_episodes
        finally:
            again.close()


def test_a_state_of_another_config_is_refused_naming_the_policy_and_changes_nothing():
    """A 64x64 run's state loaded into a 32x32 trainer raised torch's size mismatch after the trainer had taken
    the other run's iteration and history; another env's state a bare KeyError; a closed trainer took it silently."""
    from core.policies import PolicyConfig

    small = TrainConfig(env="builtin:cartpole", rollout=RolloutConfig(num_envs=4, fragment_length=8),
                        ppo=PPOConfig(num_epochs=1, minibatch_size=16))
    source = build_trainer(small)
    source.train()
    state = source.state()
    source.close()
    other = build_trainer(dataclasses.replace(small, policy=PolicyConfig(hidden_sizes=(32,))))
    try:
        with pytest.raises(ValueError, match=r"policy 'agent': its state does not fit this trainer's learner") as err:
            other.load_state_(state)
        assert "size mismatch" in str(err.value) and other.iteration == 0 and not other.history
        with pytest.raises(ValueError, match=r"the state is of a run with policies \['agents'\], and this trainer has "
                                             r"\['agent'\]"):
            other.load_state_({**state, "learners": {"agents": state["learners"]["agent"]}})
    finally:
        other.close()
    with pytest.raises(RuntimeError, match="this trainer was closed"):
        other.load_state_(state)
