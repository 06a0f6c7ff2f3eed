"""Learners (seed 002): own a policy and its optimizer, train when enough data arrived, publish weights.

A learner never tracks actors: actors ``receive`` data into it whenever they like and read ``published()``
weights when told to sync. Weights travel as a detached TensorDict (``TensorDict.from_module``) with a
version number that increases by one per training step.

- :class:`PPOLearner`: clipped PPO on every group mapped to its policy (core/losses).
- :class:`FixedLearner`: a random, scripted or frozen policy; ignores experience, version stays 0.
"""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from core.buffers import concat_fragments, filter_stale, flatten_transitions
from core.layout import ACTION_MASK, MASK, NEXT, OBSERVATION, SHARED, STATE_VALUE
from core.losses import PPOConfig, credit_absent_steps, ppo_update_, with_gae
from core.policies import GroupPolicy


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _actor_copy(policy: GroupPolicy, weights: TensorDictBase) -> GroupPolicy:
    copy_ = copy.deepcopy(policy).cpu()
    with torch.no_grad():
        TensorDict.from_module(copy_).update_(weights)
    return copy_


class PPOLearner:
    """Trains ``policy`` with PPO on the ``groups`` mapped to it.

    Args:
        policy: the module to train (the learner's own copy; actors hold others).
        groups: group -> bool ``[A]`` slots this policy acts for (None: all) — the data that trains it
            (several groups: parameter sharing across groups; a slot mask: a group split between policies).
        ppo: loss, estimator and update settings.
        lr: Adam learning rate.
        batch_steps: env steps of data that make a training batch (``train_batch_size``).
        seed: seeds the minibatch order.
        device: where the policy trains.
        max_staleness: with data from older versions (asynchronous mode), drop what lags by more than this.
    """

    def __init__(self, policy: GroupPolicy, groups: Mapping[str, torch.Tensor | None], *, ppo: PPOConfig, lr: float, batch_steps: int,
                 seed: int = 0, device: str | torch.device = "cpu", max_staleness: int | None = None) -> None:
        self.device = torch.device(device)
        self.policy = policy.to(self.device)
        self.groups = dict(groups)
        self.ppo, self.lr, self.batch_steps = ppo, lr, batch_steps
        self.max_staleness = max_staleness
        fused = self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr, eps=1e-5, fused=fused)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.counters = {"fragments_received": 0, "env_steps_stale": 0, "skipped_steps": 0, "env_steps_trained": 0}
        self._pending: list[TensorDictBase] = []
        self._pending_steps = 0
        self._published = self._snapshot()

    def _snapshot(self) -> TensorDictBase:
        """A detached copy of the weights on the CPU (one traversal: 0.16 ms against 0.67 ms for
        ``detach().clone().cpu()``, which walks the tree three times; CartPole's 64x64 actor-critic)."""
        with torch.no_grad():  # clones made without grad tracking do not require grad
            weights = TensorDict.from_module(self.policy)
            return weights.clone() if self.device.type == "cpu" else weights.to("cpu")

    # -- data in -----------------------------------------------------------------------------------------
    def receive(self, fragment: TensorDictBase) -> None:
        """Queues a fragment ``[E, T]`` by reference: learners fed the same fragment share its memory."""
        self._pending.append(fragment)
        self._pending_steps += fragment.batch_size.numel()
        self.counters["fragments_received"] += 1

    def ready(self) -> bool:
        """Whether a full training batch has arrived."""
        return self._pending_steps >= self.batch_steps

    # -- training ----------------------------------------------------------------------------------------
    def _with_values(self, batch: TensorDictBase, group: str) -> TensorDictBase:
        """Adds critic values at every observation and next observation, each in one batched call:
        ``(group, "state_value")`` (unless the actor recorded them) and ``("next", group, "state_value")``."""
        for root in (batch, batch.get(NEXT)):
            g = root.get(group)
            if root is batch and STATE_VALUE in g.keys():
                continue
            obs = {OBSERVATION: g.get(OBSERVATION)}
            if MASK in g.keys():
                obs[MASK] = g.get(MASK)
            g.set(STATE_VALUE, self.policy.value(TensorDict(obs, batch_size=g.batch_size), root.get(SHARED, None)))
        return batch

    @staticmethod
    def _drop_trivial_masks(flat: TensorDictBase, group: str) -> TensorDictBase:
        """Removes an all-True agent mask or action mask: the unmasked loss path is ~20% cheaper."""
        g = flat.get(group)
        trivial = [k for k in (MASK, ACTION_MASK) if k in g.keys() and bool(g.get(k).all())]
        if not trivial:
            return flat
        out = flat.copy()
        out.set(group, g.exclude(*trivial))
        return out

    def _only_slots(self, batch: TensorDictBase, group: str) -> TensorDictBase:
        """Narrows ``(group, "mask")`` to this policy's slots (other policies' agents are not trained on)."""
        slots = self.groups[group]
        if slots is None:
            return batch
        g = batch.get(group).copy()
        g.set(MASK, g.get(MASK) & slots.to(g.device))
        out = batch.copy()
        out.set(group, g)
        return out

    def train(self, progress: float = 0.0) -> dict[str, float]:
        """One PPO update on the pending data (call when :meth:`ready`); publishes a new version.

        Args:
            progress: fraction of the run done, in [0, 1] (drives learning-rate annealing if the caller wants).
        """
        fragments, self._pending, self._pending_steps = self._pending, [], 0
        batch = concat_fragments(fragments).to(self.device)
        metrics: dict[str, float] = {}
        for group in self.groups:
            if self.max_staleness is not None:
                batch, dropped = filter_stale(batch, group, self.version, self.max_staleness)
                self.counters["env_steps_stale"] += int(dropped)
            with torch.no_grad():
                batch = credit_absent_steps(batch, group)  # turn-based rewards reach the mover's last step
                batch = self._only_slots(batch, group)
                batch = self._with_values(batch, group)
                batch = with_gae(batch, group, self.ppo.gamma, self.ppo.gae_lambda)
            flat = self._drop_trivial_masks(flatten_transitions(batch), group)

            def evaluate(mb, group=group):
                return self.policy.evaluate_terms(mb.get(group), mb.get(SHARED, None))

            out = ppo_update_(self.policy, self.optimizer, flat, evaluate, self.ppo, self.generator, group=group)
            for k, v in out.items():
                metrics[f"{group}/{k}" if len(self.groups) > 1 else k] = float(v)
            self.counters["skipped_steps"] += int(out.get("skipped_steps", 0))
        self.counters["env_steps_trained"] += batch.batch_size.numel()
        self.version += 1
        self._published = self._snapshot()
        return metrics

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every parameter group (annealing)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # -- weights out -------------------------------------------------------------------------------------
    def published(self) -> tuple[int, TensorDictBase]:
        """The newest published ``(version, weights)``; weights live on the CPU and are never mutated."""
        return self.version, self._published

    def actor_policy(self) -> GroupPolicy:
        """A CPU copy of the policy with the published weights, for an actor (training or evaluation)."""
        return _actor_copy(self.policy, self._published)


class FixedLearner:
    """A policy that does not learn (random, scripted or frozen): ignores data; its version changes only
    when a league hands it other frozen weights (:meth:`replace_weights`)."""

    def __init__(self, policy: GroupPolicy) -> None:
        self.policy = policy
        self.version = 0
        self.counters = {"fragments_received": 0}
        self._published = TensorDict.from_module(policy).detach().clone()

    def receive(self, fragment: TensorDictBase) -> None:
        """Counts and drops the fragment."""
        self.counters["fragments_received"] += 1

    def ready(self) -> bool:
        """Never has anything to train."""
        return False

    def train(self, progress: float = 0.0) -> dict[str, float]:
        """Nothing to do."""
        return {}

    def published(self) -> tuple[int, TensorDictBase]:
        """The frozen weights."""
        return self.version, self._published

    def actor_policy(self) -> GroupPolicy:
        """A CPU copy of the frozen policy, for an actor."""
        return _actor_copy(self.policy, self._published)

    def replace_weights(self, weights: TensorDictBase) -> int:
        """Freezes other weights (a league swapping opponents); actors pick them up at their next sync.

        Returns:
            The new version.
        """
        with torch.no_grad():
            TensorDict.from_module(self.policy).update_(weights)
        self._published = TensorDict.from_module(self.policy).detach().clone()
        self.version += 1
        return self.version


__all__ = ["FixedLearner", "PPOLearner", "resolve_device"]
