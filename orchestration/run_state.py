"""A trainer's whole state as tensors + JSON (for checkpoints), and its exact restoration.

What makes a resumed run continue exactly like an uninterrupted one: policy weights, optimizer moments,
every generator (minibatch order, action sampling, env), the actors' current observations and episode
bookkeeping, the envs' own state (when the env offers ``state_dict``/``load_state_dict``), and the counters.
An env without ``state_dict`` (most gymnasium envs) is reset on resume instead: training goes on correctly,
but the continuation is no longer bit-identical; ``resume_exact`` in the returned state says which.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from typing import Any

import torch
from tensordict import TensorDict

from core.specs import to_json
from orchestration.checkpoint import flatten_optimizer, restore_optimizer
from orchestration.config import TrainConfig
from orchestration.learner import PPOLearner


def config_to_dict(config) -> dict[str, Any]:
    """A config dataclass as JSON-able dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _td_tensors(prefix: str, td: TensorDict) -> dict[str, torch.Tensor]:
    return {f"{prefix}/{'/'.join(k) if isinstance(k, tuple) else k}": v
            for k, v in td.items(include_nested=True, leaves_only=True)}


def _td_meta(td: TensorDict) -> dict:
    groups = {"/".join(k) if isinstance(k, tuple) else k: list(v.batch_size)
              for k, v in td.items(include_nested=True) if isinstance(v, TensorDict)}
    return {"batch": list(td.batch_size), "groups": groups}


def _td_from(prefix: str, tensors: dict[str, torch.Tensor], meta: dict) -> TensorDict:
    td = TensorDict(batch_size=meta["batch"])
    for key in sorted(meta["groups"], key=lambda k: k.count("/")):  # parents first
        td.set(tuple(key.split("/")), TensorDict(batch_size=meta["groups"][key]))
    head = f"{prefix}/"
    for key, value in tensors.items():
        if key.startswith(head):
            td.set(tuple(key[len(head):].split("/")), value)
    return td


def trainer_state(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, tensors, json_state)`` of a local trainer."""
    weights, tensors = {}, {}
    state: dict[str, Any] = {"config": config_to_dict(trainer.config), "tree": to_json(trainer.tree),
                             "iteration": trainer.iteration, "env_steps": trainer.env_steps,
                             "history": {k: list(v) for k, v in trainer.history.items()},
                             "learners": {}, "actors": [],
                             "resume_exact": getattr(trainer, "resume_exact", True)}
    for pid, learner in trainer.learners.items():
        for name, value in learner.policy.state_dict().items():
            weights[f"{pid}/{name}"] = value
        entry: dict[str, Any] = {"version": learner.version, "counters": dict(learner.counters)}
        if isinstance(learner, PPOLearner):
            opt_tensors, entry["optimizer"] = flatten_optimizer(f"optimizer/{pid}", learner.optimizer)
            tensors.update(opt_tensors)
            tensors[f"rng/learner/{pid}"] = learner.generator.get_state()
        state["learners"][pid] = entry
    for i, actor in enumerate(trainer.actors):
        state["actors"].append(_actor_state(f"actor/{i}", actor, tensors))
        state["resume_exact"] &= state["actors"][-1]["env_state"]
    return weights, tensors, state


def _actor_state(prefix: str, actor, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensors[f"{prefix}/rng"] = actor.generator.get_state()
    tensors[f"{prefix}/episode_start"] = actor._episode_start
    tensors.update(_td_tensors(f"{prefix}/obs", actor._obs))
    tracker = actor.builder.tracker
    tensors[f"{prefix}/episode_count"] = tracker.episode_count
    meta: dict[str, Any] = {"obs": _td_meta(actor._obs), "sequence": actor.builder.sequence,
                            "versions": actor.versions, "env_steps": actor.env_steps, "carry": None,
                            "env_state": hasattr(actor.env, "state_dict")}
    if tracker.carry is not None:
        tensors.update(_td_tensors(f"{prefix}/carry", tracker.carry))
        meta["carry"] = _td_meta(tracker.carry)
    for group, h in actor._rnn.items():
        if h is not None:
            tensors[f"{prefix}/rnn/{group}"] = h
    if meta["env_state"]:
        for key, value in actor.env.state_dict().items():
            tensors[f"{prefix}/env/{key}"] = value
    return meta


def restore_trainer_(trainer, weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                     state: dict[str, Any]) -> None:
    """Loads a checkpoint's state into a freshly built trainer of the same config (mutates it)."""
    trainer.iteration, trainer.env_steps = state["iteration"], state["env_steps"]
    for key, values in state["history"].items():
        trainer.history.setdefault(key, deque(maxlen=100)).extend(values)
    for pid, learner in trainer.learners.items():
        entry = state["learners"][pid]
        own = {k.split("/", 1)[1]: v for k, v in weights.items() if k.startswith(f"{pid}/")}
        learner.policy.load_state_dict(own)
        learner.version = entry["version"]
        learner.counters.update(entry["counters"])
        if isinstance(learner, PPOLearner):
            restore_optimizer(f"optimizer/{pid}", learner.optimizer, tensors, entry["optimizer"])
            learner.generator.set_state(tensors[f"rng/learner/{pid}"])
            learner._published = learner._snapshot()
    for i, (actor, meta) in enumerate(zip(trainer.actors, state["actors"])):
        _restore_actor(f"actor/{i}", actor, tensors, meta, trainer.learners)


def _restore_actor(prefix: str, actor, tensors, meta, learners) -> None:
    for pid in actor.policies:
        actor.versions[pid] = -1  # force the copy below
        actor.set_weights(pid, *learners[pid].published())
    actor.versions.update(meta["versions"])
    actor.generator.set_state(tensors[f"{prefix}/rng"])
    actor.env_steps = meta["env_steps"]
    actor.builder.sequence = meta["sequence"]
    actor.builder.tracker.episode_count = tensors[f"{prefix}/episode_count"].clone()
    if meta["carry"] is not None:
        actor.builder.tracker.carry = _td_from(f"{prefix}/carry", tensors, meta["carry"])
    for group in actor._rnn:
        key = f"{prefix}/rnn/{group}"
        actor._rnn[group] = tensors[key] if key in tensors else None
    if meta["env_state"] and hasattr(actor.env, "load_state_dict"):
        head = f"{prefix}/env/"
        actor.env.load_state_dict({k[len(head):]: v for k, v in tensors.items() if k.startswith(head)})
        actor._obs = _td_from(f"{prefix}/obs", tensors, meta["obs"])
        actor._episode_start = tensors[f"{prefix}/episode_start"].clone()
    # else: the env was reset when the actor was built: a new episode starts in every env.


def load_config(state: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` stored in a checkpoint's state."""
    from core.losses import PPOConfig
    from core.policies import PolicyConfig
    from orchestration.config import RayConfig, RolloutConfig

    raw = dict(state["config"])
    raw["rollout"] = RolloutConfig(**raw["rollout"])
    raw["ppo"] = PPOConfig(**raw["ppo"])
    policy = dict(raw["policy"])
    policy["hidden_sizes"] = tuple(policy["hidden_sizes"])
    raw["policy"] = PolicyConfig(**policy)
    raw["env_kwargs"] = tuple(tuple(p) for p in raw["env_kwargs"])
    raw["policy_mapping"] = tuple(tuple(p) for p in raw.get("policy_mapping", ()))
    raw["fixed_policies"] = tuple(raw.get("fixed_policies", ()))
    ray_raw = dict(raw.get("ray", {}))
    ray_raw["learner_resources"] = tuple(tuple(p) for p in ray_raw.get("learner_resources", ()))
    raw["ray"] = RayConfig(**ray_raw)
    return TrainConfig(**raw)


__all__ = ["config_to_dict", "load_config", "restore_trainer_", "trainer_state"]
