"""Trainer (seed 002): one ``train()`` call runs one iteration of seed 000's synchronous loop.

collect ``train_batch_size`` env steps with the training actors -> ``sync`` (data to learners) -> every ready
learner trains ``num_epochs`` over minibatches -> ``sync`` (new weights to actors) -> evaluate now and then.

The trainer is written against plain objects (actors, learners); the Ray backend hands it remote-backed
ones with the same methods. :func:`build_trainer` is the composition root of a local run.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from typing import Mapping, Sequence

import torch

from core.policies import GroupPolicy, make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign, groups_of
from orchestration.config import TrainConfig
from orchestration.envs import make_run_env
from orchestration.learner import FixedLearner, PPOLearner, resolve_device


def episode_metrics(history: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Means over the last finished episodes: ``episode_return_mean`` (100), ``episode_return_mean_10``,
    ``episode_length_mean`` and, with several policies, ``episode_return_mean/<policy>``."""
    out: dict[str, float] = {}
    several = sum(k.startswith("return/") for k in history) > 1
    for key, window in history.items():
        if key.startswith("return/") and not several:
            continue
        name = {"return": "episode_return_mean", "length": "episode_length_mean"}.get(
            key, key.replace("return/", "episode_return_mean/"))
        out[name] = sum(window) / len(window) if window else math.nan
    last10 = list(history.get("return", []))[-10:]
    out["episode_return_mean_10"] = sum(last10) / len(last10) if last10 else math.nan
    out.setdefault("episode_return_mean", math.nan)
    return out


def build_policies(config: TrainConfig, tree, assignment) -> tuple[dict[str, GroupPolicy], set[str]]:
    """Policy id -> initial module, and the ids that do not learn; the same draws on every backend
    (call right after ``torch.manual_seed(config.seed)``)."""
    policies = make_policies(tree, config.policy)
    out, fixed = {}, set()
    for pid in sorted({p for a in assignment.values() for p in a.policies}):
        policy = policies.get(pid) or _policy_for(pid, assignment, policies)
        if pid in config.fixed_policies or pid == "random":
            fixed.add(pid)
            policy = _uniform(policy) if pid == "random" else policy
        out[pid] = policy
    return out, fixed


def make_actor(env, learners, assignment, *, evaluation: bool = False, **kwargs) -> Actor:
    """An actor on ``env`` whose policies come from the learners (seed 002: learners yield actors).

    A training actor samples and records fragments; an evaluation actor (``evaluation=True``) acts with the
    modes of the learning policies (fixed ones, such as a random opponent, keep sampling) and records nothing.
    """
    policies = {pid: learner.actor_policy() for pid, learner in learners.items()}
    if evaluation:
        kwargs.update(record=False, deterministic=[p for p, lrn in learners.items() if isinstance(lrn, PPOLearner)])
    return Actor(env, policies, assignment, **kwargs)


def _policy_for(pid: str, assignment, policies: dict[str, GroupPolicy]) -> GroupPolicy:
    """A fresh module for a policy id that is not a group name (from the first group it acts in)."""
    group = next(g for g, a in assignment.items() if pid in a.policies)
    policy = copy.deepcopy(policies[group])
    for module in policy.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return policy


def _uniform(policy: GroupPolicy) -> GroupPolicy:
    """The random policy: zero action-parameter layer, so every legal action is equally likely."""
    policy = copy.deepcopy(policy)
    with torch.no_grad():
        policy.actor_out.weight.zero_()
        policy.actor_out.bias.zero_()
    return policy


class Trainer:
    """Runs iterations over actors and learners and keeps the run's counters.

    Args:
        config: the run.
        actors: training actors (one per rollout worker in the local backend).
        learners: policy id -> learner.
        eval_actor: a deterministic actor on separate envs, or None.
    """

    def __init__(self, config: TrainConfig, actors: list[Actor], learners: Mapping, eval_actor: Actor | None,
                 tree) -> None:
        self.config, self.actors, self.learners, self.eval_actor = config, actors, dict(learners), eval_actor
        self.tree = tree
        self.iteration = 0
        self.env_steps = 0
        self.history: dict[str, deque[float]] = {}
        """Last 100 finished episodes: ``"return"``, ``"length"``, ``"return/<policy>"``."""
        self.last_episodes: dict[str, list[float]] = {}
        """The episodes that finished during the last iteration, same keys."""

    def _collect(self) -> float:
        """Collects one iteration's fragments; returns the seconds spent."""
        start = time.perf_counter()
        target = self.config.steps_per_iteration
        collected = 0
        while collected < target:
            for actor in self.actors:
                fragment = actor.collect()
                collected += fragment.batch_size.numel()
        self.env_steps += collected
        return time.perf_counter() - start

    def _episodes(self) -> dict[str, float]:
        finished = 0
        self.last_episodes = {}
        for actor in self.actors:
            for key, values in actor.completed_episodes().items():
                values = values.double().tolist()
                self.history.setdefault(key, deque(maxlen=100)).extend(values)
                self.last_episodes.setdefault(key, []).extend(values)
                finished += len(values) if key == "length" else 0
        return {"episodes": finished, **episode_metrics(self.history)}

    def train(self) -> dict[str, float]:
        """One iteration; returns its metrics (plain floats)."""
        cfg = self.config
        progress = self.iteration / max(cfg.iterations, 1)
        if cfg.anneal_lr:
            for learner in self.learners.values():
                if isinstance(learner, PPOLearner):
                    learner.set_lr(cfg.lr * max(0.0, 1.0 - progress))  # past the budget: stay at 0
        t_collect = self._collect()
        for actor in self.actors:
            actor.sync(self.learners)  # data out (weights unchanged: nothing trained yet)
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        for pid, learner in self.learners.items():
            if learner.ready():
                out = learner.train(progress)
                metrics.update({f"{pid}/{k}" if len(self.learners) > 1 else k: v for k, v in out.items()})
        t_learn = time.perf_counter() - start
        for actor in self.actors:
            actor.sync(self.learners)  # new weights in
        self.iteration += 1
        metrics.update(self._episodes())
        metrics.update(iteration=self.iteration, env_steps=self.env_steps, time_collect=t_collect,
                       time_learn=t_learn, env_steps_per_s=self.config.steps_per_iteration / max(t_collect, 1e-9))
        if self.eval_actor is not None and cfg.eval_every and self.iteration % cfg.eval_every == 0:
            metrics.update(self.evaluate())
        return metrics

    def evaluate(self, episodes: int | None = None) -> dict[str, float]:
        """Mean returns of deterministic actors with the newest weights over ``episodes`` episodes:
        ``eval_return_mean`` (all agents) and, with several policies, ``eval_return_mean/<policy>``."""
        actor = self.eval_actor
        if actor is None:
            raise ValueError("this trainer has no evaluation actor")
        for pid, learner in self.learners.items():
            actor.set_weights(pid, *learner.published())
        results = actor.run_episodes(episodes or self.config.eval_episodes)
        out = {}
        for key, values in results.items():
            if key.startswith("return/") and len(self.learners) < 2:
                continue
            out[key.replace("return", "eval_return_mean", 1)] = sum(values) / max(len(values), 1)
        return out


def build_trainer(config: TrainConfig) -> Trainer:
    """The composition root of a local run: envs, policies, learners, actors, from one config."""
    torch.manual_seed(config.seed)  # initial weights: the only use of the global generator, at the entry point
    rc = config.rollout
    envs = [make_run_env(config, rc.num_envs) for _ in range(rc.num_workers)]
    tree = envs[0].tree
    assignment = assign(tree, dict(config.policy_mapping))
    policies, fixed = build_policies(config, tree, assignment)
    device = resolve_device(config.device)
    learners = {}
    for pid, policy in policies.items():
        if pid in fixed:
            learners[pid] = FixedLearner(policy)
        else:
            learners[pid] = PPOLearner(policy, groups_of(assignment, pid), ppo=config.ppo, lr=config.lr,
                                       batch_steps=config.steps_per_iteration, seed=config.seed, device=device)
    actors = [make_actor(env, learners, assignment, fragment_length=rc.fragment_length,
                         seed=config.seed + 1000 * i, worker_id=i) for i, env in enumerate(envs)]
    eval_actor = None
    if config.eval_every:
        eval_env = make_run_env(config, min(rc.num_envs, config.eval_episodes))
        eval_actor = make_actor(eval_env, learners, assignment, seed=config.seed + 10**6, evaluation=True)
    return Trainer(config, actors, learners, eval_actor, tree)


__all__ = ["Trainer", "build_policies", "build_trainer", "episode_metrics", "make_actor"]
