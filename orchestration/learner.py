"""Learners (seed 002): own a policy and its optimizer, train when enough data arrived, publish weights.

The Learner protocol, which every backend implements (a local object here; a remote handle with the same
methods in :mod:`orchestration.ray_learner`). Usage loop (what :class:`orchestration.trainer.Trainer` does)::

    learner.receive(fragment, meta)             # fleets deliver fragments (meta: Actor.fragment_meta)
    pending = learner.submit(progress, lr)      # train if a batch is ready
    result = pending.result()                   # None: not ready; else {"metrics", "version", "weights", ...}
    version, weights = learner.published()      # the newest weights, in the fleet's transport form
    state = learner.state(); learner.load_state_(state)   # checkpoints (numpy arrays and JSON values)

A learner never tracks actors. Weights are a detached TensorDict (``TensorDict.from_module``) with a version
that increases by one per training step. The staleness and reuse rules live in the learner's
:class:`orchestration.inbox.Inbox` (core's rules), the same on every backend.

- :class:`PPOLearner`: clipped PPO on every group mapped to its policy (core/losses); ``for metrics in
  learner.run(fragments): ...`` trains from any stream of fragments, without a Trainer.
- :class:`FixedLearner`: a random, scripted or frozen policy; ignores experience; its version changes only
  when a league hands it other frozen weights.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from core.buffers import concat_fragments
from core.layout import FRAGMENT_ID, OBSERVATION, POLICY_VERSION, WORKER_ID
from core.losses import PPOConfig, credit_absent_steps, ppo_update_
from core.policies import GroupPolicy
from orchestration.checkpoint import flatten_optimizer, restore_optimizer
from orchestration.curiosity import CuriosityConfig, curiosity_for
from orchestration.devices import check_compute_dtype
from orchestration.inbox import Inbox
from orchestration.reward_scaling import ReturnStreams
from orchestration.train_batches import (counted_rows, marked_fresh, only_slots, team_values_for, update_inputs,
                                          with_advantages, with_values, without_marks)
from orchestration.weights_fit import check_weights


def _actor_copy(policy: GroupPolicy, weights: TensorDictBase) -> GroupPolicy:
    copy_ = copy.deepcopy(policy).cpu()
    with torch.no_grad():
        TensorDict.from_module(copy_).update_(weights)
    return copy_


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _tensor(array) -> torch.Tensor:  # np.array: a writable copy of a possibly read-only view
    return array.clone() if isinstance(array, torch.Tensor) else torch.from_numpy(np.array(array))


class NonFiniteTraining(RuntimeError):
    """Training cannot go on: every update step of several updates in a row was skipped as non-finite."""


class Done:
    """A training request that has finished (a local learner trains when asked): ``result()`` at once."""

    def __init__(self, value: dict[str, Any] | None) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self) -> dict[str, Any] | None:
        return self._value


def meta_of(fragment: TensorDictBase, policy_id: str, group: str) -> dict[str, Any]:
    """The delivery metadata of a fragment read from its own tensors (for callers that pass none)."""
    fid = int(fragment.get(FRAGMENT_ID)[0, 0])
    return {"fragment_id": fid, "worker_id": int(fragment.get(WORKER_ID)[0, 0]), "sequence": fid & 0xFFFFFFFF,
            "policy_versions": {policy_id: int(fragment.get((POLICY_VERSION, group))[0, 0])}}


class PPOLearner:
    """Trains ``policy`` with PPO on the ``groups`` mapped to it.

    Args:
        policy: the module to train (the learner's own copy; actors hold others).
        groups: group -> bool ``[A]`` slots this policy acts for (None: all) — the data that trains it
            (several groups: parameter sharing across groups; a slot mask: a group split between policies).
        policy_id: the policy's id (reads its version in delivery metadata).
        ppo: loss, estimator and update settings.
        lr: Adam learning rate.
        batch_steps: env steps of data that make a training batch (``train_batch_size``).
        seed: seeds the minibatch order.
        device: where the policy trains.
        max_staleness: drop data lagging the learner by more than this many versions (None: never).
        reuse_limit: times a fragment may be trained on (asynchronous mode tops batches up with reused data).
        max_skipped_updates: raise :class:`NonFiniteTraining` after this many consecutive updates whose every
            step was skipped (0: never).
        curiosity: an RND curiosity bonus on the rewards (:mod:`orchestration.curiosity`); None or coef 0: none.
    """

    learns = True

    def __init__(self, policy: GroupPolicy, groups: Mapping[str, torch.Tensor | None], *, policy_id: str = "policy",
                 ppo: PPOConfig, lr: float, batch_steps: int, seed: int = 0, device: str | torch.device = "cpu",
                 max_staleness: int | None = None, reuse_limit: int = 1, max_skipped_updates: int = 0,
                 curiosity: CuriosityConfig | None = None) -> None:
        self.device = torch.device(device)
        check_compute_dtype(self.device, ppo.compute_dtype)
        self.max_skipped_updates, self._skipped_in_a_row = max_skipped_updates, 0
        self.policy = policy.to(self.device)
        self.groups = dict(groups)
        self.policy_id = policy_id
        self.ppo, self.lr, self.batch_steps = ppo, lr, batch_steps
        fused = self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr, eps=1e-5, fused=fused)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.counters = {"fragments_received": 0, "skipped_steps": 0, "env_steps_trained": 0, "train_steps": 0}
        self.inbox = Inbox(policy_id, batch_steps, max_staleness=max_staleness, reuse_limit=reuse_limit)
        self.last_fragment_ids: list[int] = []
        """Fragment ids of the last training batch, in batch order."""
        self.keep_last_batch = False
        """Keep the last batch's inbox entries in :attr:`last_batch` (a learner actor's probes; they pin it)."""
        self.last_batch: list = []
        scaler = getattr(policy, "reward_scaler", None)  # PolicyConfig.scale_rewards
        self.returns = None if scaler is None else ReturnStreams(ppo.gamma, self.groups, scaler)
        self.curiosity = curiosity_for(curiosity, self.policy, list(self.groups), seed=seed, device=self.device)
        self.evaluate_through: Callable | None = None  # training forwards as (evaluate, mb): DDP (data_parallel_)
        self.update_through: Callable | None = None  # (fragments, progress, team) -> metrics: a DDP rank 0's shards
        self.reduce_statistics: Callable | None = None  # sums normalisers' moments over DDP ranks (data_parallel_)
        self._published = self._snapshot()

    def _snapshot(self) -> TensorDictBase:
        """A detached copy of the weights on the CPU (one traversal of the module tree)."""
        with torch.no_grad():  # clones made without grad tracking do not require grad
            weights = TensorDict.from_module(self.policy)
            return weights.clone() if self.device.type == "cpu" else weights.to("cpu")

    # -- data in -----------------------------------------------------------------------------------------
    def receive(self, fragment: TensorDictBase, meta: Mapping[str, Any] | None = None) -> str | None:
        """Files a fragment ``[E, T]`` by reference (learners fed the same fragment share its memory; nothing
        writes into it). ``meta``: its delivery metadata (read from the fragment when None).

        Returns:
            ``"accepted"`` or ``"stale"``; None for a re-delivery (ignored, counted as a duplicate).
        """
        if meta is None:
            meta = meta_of(fragment, self.policy_id, next(iter(self.groups)))
        self.counters["fragments_received"] += 1
        if not self.inbox.announce(meta):
            return None
        return self.inbox.add(fragment, meta, self.version)

    def settle(self, produced: Mapping[int, int]) -> int:
        """Counts as lost what the workers produced (worker id -> fragments) and never delivered here."""
        return self.inbox.settle(produced)

    def ready(self) -> bool:
        """Whether a training batch has arrived."""
        return self.inbox.ready(self.version)

    def new_steps(self) -> int:
        """Env steps of fresh data not trained on yet."""
        return self.inbox.new_steps(self.version)

    # -- training ----------------------------------------------------------------------------------------
    def update_(self, fragments: list[TensorDictBase], progress: float = 0.0,
                team_values: list[TensorDictBase] | None = None) -> dict[str, float]:
        """One PPO update on ``fragments`` (the math; no inbox rules); publishes a new version.

        Args:
            fragments: ``[E_i, T]`` fragments, concatenated along env; statistics count rows ``FRESH`` marks (if
                any), reward scaling reads ``STREAM_RETURNS`` where a data-parallel rank 0 put them.
            progress: fraction of the run done, in [0, 1].
            team_values: a team critic's values of each fragment (:mod:`orchestration.team_critic`), or None.
        """
        batch = concat_fragments(fragments).to(self.device)
        batch, fresh = without_marks(batch)  # fresh [N, T]: rows first trained now (None: every row)
        team = None if team_values is None else concat_fragments(team_values).to(self.device)
        metrics: dict[str, float] = {}
        for group in self.groups:  # running observation statistics first: this update trains with them
            rows = counted_rows(g := batch.get(group), self.groups[group], fresh, self.device)
            self.policy.observe_(g.get(OBSERVATION), rows, self.reduce_statistics)
        if self.returns is not None:  # and the return statistics (orchestration.reward_scaling)
            metrics["reward_scale"] = self.returns.observe_(fragments, self.reduce_statistics)
        for group in self.groups:
            with torch.no_grad():
                batch = credit_absent_steps(batch, group)  # turn-based rewards reach the mover's last step
                if self.curiosity is not None:  # the RND bonus joins the env's reward (trains its predictor)
                    batch = self.curiosity.add_bonus_(batch, group, self.groups[group], metrics, fresh)
                if self.returns is not None:
                    batch = self.returns.scaled(batch, group)
                batch = only_slots(batch, group, self.groups[group])  # other policies' agents: not trained on
                batch = with_values(self.policy, batch, group, team)
                batch = with_advantages(self.policy, batch, group, self.ppo)
            flat, evaluate, ppo = update_inputs(self.policy, batch, group, self.ppo, team)
            if self.evaluate_through is not None:  # DDP over the policy: averages gradients over ranks
                evaluate = functools.partial(self.evaluate_through, evaluate)
            out = ppo_update_(self.policy, self.optimizer, flat, evaluate, ppo, self.generator, group=group)
            out = out.exclude("loss_value", "explained_variance") if team is not None and group in team.keys() else out
            for k, v in out.items():
                metrics[f"{group}/{k}" if len(self.groups) > 1 else k] = float(v)
            self.counters["skipped_steps"] += int(out.get("skipped_steps", 0))
            all_skipped = int(out["num_minibatches"]) > 0 and int(out["skipped_steps"]) == int(out["num_minibatches"])
            self._check_skipped(all_skipped, flat)
        self.counters["env_steps_trained"] += batch.batch_size.numel()
        self.counters["train_steps"] += 1
        self.version += 1
        self._published = self._snapshot()
        return metrics

    def _check_skipped(self, all_skipped: bool, batch: TensorDictBase) -> None:
        """Counts updates whose every step was skipped; past the limit, raises naming the first non-finite
        tensor (a parameter, else an entry of the batch)."""
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if all_skipped else 0
        if not self.max_skipped_updates or self._skipped_in_a_row < self.max_skipped_updates:
            return
        culprit = next((f"parameter {n!r}" for n, p in self.policy.named_parameters()
                        if not bool(torch.isfinite(p).all())), None)
        if culprit is None:
            culprit = next((f"batch entry {k!r}" for k, v in batch.items(True, True)
                            if v.is_floating_point() and not bool(torch.isfinite(v).all())), "the loss")
        raise NonFiniteTraining(f"policy {self.policy_id!r}: {self._skipped_in_a_row} consecutive updates were "
                                f"skipped entirely (non-finite loss or gradients); first non-finite tensor: "
                                f"{culprit}. Lower the learning rate (TrainConfig.lr), check the env's rewards and "
                                f"observations, or raise TrainConfig.max_skipped_updates.")

    def train(self, progress: float = 0.0, *, lr: float | None = None, take_all: bool = True,
              team_values: Mapping[int, TensorDictBase] | None = None) -> dict[str, float]:
        """One PPO update on the inbox's next batch (``take_all``: every fresh fragment); ``{}`` if it has none.

        Args:
            progress: fraction of the run done, in [0, 1].
            lr: set this learning rate first (annealing), or None.
            take_all: synchronous mode (all fresh data) or one batch topped up with reusable data (async).
            team_values: fragment id -> a team critic's values (:meth:`TeamCriticLearner.values`), or None.
        """
        entries = self.inbox.take(self.version, take_all)
        if not entries:
            return {}
        if lr is not None:
            self.set_lr(lr)
        self.last_fragment_ids = [int(e.meta["fragment_id"]) for e in entries]
        self.last_batch = entries if self.keep_last_batch else []
        reused = any(e.uses > 1 for e in entries)  # then statistics count only the rows trained the first time
        fragments = [marked_fresh(e.fragment, e.uses == 1) if reused else e.fragment for e in entries]
        return (self.update_through or self.update_)(fragments, progress,
                                                     team_values_for(team_values, self.last_fragment_ids, self.policy_id))

    def submit(self, progress: float = 0.0, lr: float | None = None, take_all: bool = False,
               team_values: Mapping[int, TensorDictBase] | None = None) -> Done:
        """Trains now if :meth:`ready`; the result: None, or ``{"metrics", "version", "weights",
        "fragment_ids", "dropped_ids", "time_learn"}`` (``weights`` as :meth:`published` gives them;
        ``dropped_ids``: fragments dropped as stale since the last result, never trained)."""
        if not self.ready():
            return Done(None)
        start = time.perf_counter()
        metrics = self.train(progress, lr=lr, take_all=take_all, team_values=team_values)
        version, weights = self.published()
        return Done({"metrics": metrics, "version": version, "weights": weights,
                     "fragment_ids": list(self.last_fragment_ids), "dropped_ids": self.inbox.take_dropped(),
                     "time_learn": time.perf_counter() - start})

    def run(self, fragments: Iterable, until: Callable[[Mapping[str, float]], bool] | None = None
            ) -> Iterator[dict[str, float]]:
        """The continuous loop of a learner fed from a stream (seed 002's ``Learner.run``): receives every
        ``fragment`` or ``(fragment, meta)`` of ``fragments`` and trains whenever a batch is ready. A generator
        yielding each update's metrics plus ``version``; it stops when the stream ends or ``until(metrics)``."""
        for item in fragments:
            fragment, meta = item if isinstance(item, tuple) else (item, None)
            self.receive(fragment, meta)
            if self.ready():
                metrics = {**self.train(), "version": float(self.version)}
                self.inbox.take_dropped()  # no credit pool here to give them back to
                yield metrics
                if until is not None and until(metrics):
                    return

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every parameter group (annealing)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # -- weights out -------------------------------------------------------------------------------------
    def published(self) -> tuple[int, TensorDictBase]:
        """The newest published ``(version, weights)``; weights live on the CPU and are never mutated."""
        return self.version, self._published

    def weights(self) -> tuple[int, TensorDictBase]:
        """``(version, weights)`` as a local TensorDict (here the same as :meth:`published`)."""
        return self.published()

    def actor_policy(self) -> GroupPolicy:
        """A CPU copy of the policy with the published weights, for an actor (training or evaluation)."""
        return _actor_copy(self.policy, self._published)

    # -- state -------------------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The inbox's ledger and counters, this learner's counters and version."""
        return {**self.inbox.report(), "learner": dict(self.counters), "version": self.version}

    def state(self) -> dict[str, Any]:
        """Weights, optimizer, generator, version, counters, the inbox ledger and the return accumulators
        (``"returns"``, with reward scaling), as numpy arrays and JSON values."""
        opt_tensors, opt_meta = flatten_optimizer("optimizer", self.optimizer)
        returns = {} if self.returns is None else {"returns": {k: _numpy(v) for k, v in self.returns.state().items()}}
        return {"weights": {k: _numpy(v) for k, v in self.policy.state_dict().items()},
                "optimizer": ({k: _numpy(v) for k, v in opt_tensors.items()}, opt_meta),
                "generator": _numpy(self.generator.get_state()), "version": self.version,
                "counters": dict(self.counters), "inbox": self.inbox.state(), **returns,
                **({} if self.curiosity is None else {"curiosity": self.curiosity.state()})}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Loads a :meth:`state` (mutates this learner) and republishes its weights."""
        self.policy.load_state_dict({k: _tensor(v) for k, v in state["weights"].items()})
        tensors, meta = state["optimizer"]
        restore_optimizer("optimizer", self.optimizer, {k: _tensor(v) for k, v in tensors.items()}, meta)
        self.generator.set_state(_tensor(state["generator"]))
        self.version = int(state["version"])
        self.counters.update(state["counters"])
        if self.curiosity is not None and "curiosity" in state:  # a state saved without the bonus keeps it fresh
            self.curiosity.load_state_(state["curiosity"])
        if "inbox" in state:
            self.inbox.load_state_(state["inbox"])
            if self.returns is not None:  # per-stream, like the ledger: kept only when the streams go on
                self.returns.load_state_(state.get("returns", {}))
        self._published = self._snapshot()

    def publish_as(self, version: int) -> None:
        """Republishes the current weights as ``version`` (a restarted learner moves above every version
        published before its restart, so every actor loads its weights)."""
        self.version = int(version)
        self._published = self._snapshot()


class FixedLearner:
    """A policy that does not learn (random, scripted or frozen): ignores data; its version changes only
    when a league hands it other frozen weights (:meth:`replace_weights`)."""

    learns = False

    def __init__(self, policy: GroupPolicy) -> None:
        self.policy = policy
        self.version = 0
        self.counters = {"fragments_received": 0}
        self._published = TensorDict.from_module(policy).detach().clone()

    def receive(self, fragment: TensorDictBase, meta: Mapping[str, Any] | None = None) -> None:
        """Counts and drops the fragment."""
        self.counters["fragments_received"] += 1

    def ready(self) -> bool:
        """Never has anything to train."""
        return False

    def submit(self, progress: float = 0.0, lr: float | None = None, take_all: bool = False) -> Done:
        """Nothing to train."""
        return Done(None)

    def published(self) -> tuple[int, TensorDictBase]:
        """The frozen weights."""
        return self.version, self._published

    def weights(self) -> tuple[int, TensorDictBase]:
        """The frozen weights."""
        return self.published()

    def actor_policy(self) -> GroupPolicy:
        """A CPU copy of the frozen policy, for an actor."""
        return _actor_copy(self.policy, self._published)

    def replace_weights(self, weights: TensorDictBase) -> int:
        """Freezes other weights (a league swapping opponents); returns the new version."""
        check_weights(TensorDict.from_module(self.policy), weights)  # ValueError naming the key at fault
        with torch.no_grad():
            TensorDict.from_module(self.policy).update_(weights)
        self._published = TensorDict.from_module(self.policy).detach().clone()
        self.version += 1
        return self.version

    def state(self) -> dict[str, Any]:
        """Weights and version."""
        return {"weights": {k: _numpy(v) for k, v in self.policy.state_dict().items()}, "version": self.version,
                "counters": dict(self.counters)}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state`."""
        self.policy.load_state_dict({k: _tensor(v) for k, v in state["weights"].items()})
        self.version = int(state["version"])
        self.counters.update(state.get("counters", {}))
        self._published = TensorDict.from_module(self.policy).detach().clone()


__all__ = ["Done", "FixedLearner", "NonFiniteTraining", "PPOLearner", "meta_of"]
