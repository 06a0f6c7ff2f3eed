"""A learner's state outside its process: checkpoint dicts, the restart registry, the driver's mirrors.

- :func:`learner_state` / :func:`load_learner_state_`: a :class:`~orchestration.learner.PPOLearner` as numpy
  arrays and JSON values (what a checkpoint and a restarted learner load);
- :class:`LearnerCheckpoints`: the registry a restarted learner asks where to resume (see
  :mod:`orchestration.ray_learner`);
- :class:`LearnerMirrors`: the driver's local copies of remote learners, for checkpoints and ``--resume``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import numpy as np
import ray
import torch

from core.policies import GroupPolicy, make_policies
from core.specs import Tree
from orchestration.assignment import GroupAssignment, assign, groups_of
from orchestration.checkpoint import flatten_optimizer, restore_optimizer
from orchestration.config import TrainConfig
from orchestration.learner import FixedLearner, PPOLearner


class LearnerCheckpoints:
    """Per policy: the driver's latest learner checkpoint (a ref), the highest version published, restarts.

    A small actor (no CPU) beside the driver; a restarted learner asks it where to resume (:meth:`resume`).
    """

    def __init__(self) -> None:
        self.refs: dict[str, list] = {}
        self.versions: dict[str, int] = {}
        self.restarts: dict[str, int] = {}

    def save(self, policy_id: str, refs: Sequence[ray.ObjectRef], version: int) -> None:
        """Registers ``[ref]`` of a :meth:`LearnerServer.checkpoint` taken at ``version`` (newest wins)."""
        self.refs[policy_id] = list(refs)
        self.published(policy_id, version)

    def published(self, policy_id: str, version: int) -> None:
        """Notes that ``version`` of ``policy_id`` was published."""
        self.versions[policy_id] = max(self.versions.get(policy_id, 0), int(version))

    def resume(self, policy_id: str) -> dict[str, Any]:
        """Called by a restarted learner: its checkpoint refs (or None), the highest version published before,
        and its restart count (this one included)."""
        self.restarts[policy_id] = self.restarts.get(policy_id, 0) + 1
        return {"refs": self.refs.get(policy_id), "version": self.versions.get(policy_id, 0),
                "restarts": self.restarts[policy_id]}


#: The checkpoint registry actor (no CPU reserved), made remote once.
RemoteLearnerCheckpoints = ray.remote(num_cpus=0)(LearnerCheckpoints)


def policy_module(tree: Tree, config: TrainConfig, assignment: Mapping[str, GroupAssignment],
                  policy_id: str) -> GroupPolicy:
    """A module with the architecture of ``policy_id`` (a group's policy, or a copy of the first group's
    it acts in); its initial values do not matter: the caller loads weights into it."""
    policies = make_policies(tree, config.policy)
    if policy_id in policies:
        return policies[policy_id]
    return copy.deepcopy(policies[next(g for g, a in assignment.items() if policy_id in a.policies)])


def learner_state(learner: PPOLearner) -> dict[str, Any]:
    """A PPO learner's weights, optimizer, generator, version and counters as numpy arrays and JSON values."""
    opt_tensors, opt_meta = flatten_optimizer("optimizer", learner.optimizer)
    return {"weights": {k: v.detach().cpu().numpy() for k, v in learner.policy.state_dict().items()},
            "optimizer": ({k: v.detach().cpu().numpy() for k, v in opt_tensors.items()}, opt_meta),
            "generator": learner.generator.get_state().numpy(), "version": learner.version,
            "counters": dict(learner.counters)}


def load_learner_state_(learner: PPOLearner, state: Mapping[str, Any]) -> None:
    """Loads a :func:`learner_state` into ``learner`` (mutates it) and re-snapshots its published weights."""
    def tensor(array) -> torch.Tensor:
        return torch.from_numpy(np.array(array))  # np.array: a writable copy of a possibly read-only view

    learner.policy.load_state_dict({k: tensor(v) for k, v in state["weights"].items()})
    tensors, meta = state["optimizer"]
    restore_optimizer("optimizer", learner.optimizer, {k: tensor(v) for k, v in tensors.items()}, meta)
    learner.generator.set_state(tensor(state["generator"]))
    learner.version = int(state["version"])
    learner.counters.update(state["counters"])
    learner._published = learner._snapshot()


class LearnerMirrors:
    """Local copies of remote learners, for checkpoints: fetched on demand, pushed back when changed.

    Args:
        config, tree: the run and its env tree (to build the modules).
        handles: policy id -> learner actor handle.
        fixed: policy id -> module of the policies that do not learn (mirrored as :class:`FixedLearner`).
    """

    def __init__(self, config: TrainConfig, tree: Tree, handles: Mapping[str, Any],
                 fixed: Mapping[str, GroupPolicy]) -> None:
        self.config, self.tree, self.handles, self.fixed = config, tree, dict(handles), dict(fixed)
        self.mirrors: dict[str, PPOLearner | FixedLearner] = {}
        self.versions: dict[str, int] = {}

    def fetch(self, refresh: bool = True,
              states: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, PPOLearner | FixedLearner]:
        """The mirrors, refreshed from the remote learners unless ``refresh`` is False (they were released).

        ``states``: policy id -> :func:`learner_state` already fetched (else fetched here).
        """
        if not self.mirrors:
            config, assignment = self.config, assign(self.tree, dict(self.config.policy_mapping))
            for pid in self.handles:
                self.mirrors[pid] = PPOLearner(policy_module(self.tree, config, assignment, pid),
                                               groups_of(assignment, pid), ppo=config.ppo, lr=config.lr,
                                               batch_steps=config.steps_per_iteration, seed=config.seed)
            self.mirrors.update({pid: FixedLearner(policy) for pid, policy in self.fixed.items()})
        if refresh:
            if states is None:
                states = dict(zip(self.handles, ray.get([h.state.remote() for h in self.handles.values()])))
            for pid, state in states.items():
                load_learner_state_(self.mirrors[pid], state)
                self.versions[pid] = self.mirrors[pid].version
        return dict(self.mirrors)

    def push_changed(self) -> list[str]:
        """Loads every mirror whose version changed since it was fetched (a restore) into its learner."""
        changed = [pid for pid in self.handles
                   if pid in self.mirrors and self.mirrors[pid].version != self.versions[pid]]
        ray.get([self.handles[pid].load_state.remote(learner_state(self.mirrors[pid])) for pid in changed])
        self.versions.update({pid: self.mirrors[pid].version for pid in changed})
        return changed


__all__ = ["LearnerCheckpoints", "LearnerMirrors", "RemoteLearnerCheckpoints", "learner_state", "load_learner_state_",
           "policy_module"]
