"""Learners fed from datasets or streams: behaviour cloning (:class:`BCLearner`), their ``run()`` loop, and
PPO starting from pretrained weights.

A :class:`StreamLearner` owns a policy and its optimizer like every learner (:mod:`orchestration.learner`:
``published()``, ``weights()``, ``state()``/``load_state_()``, ``report()``), but pulls its own data instead
of waiting for fleet fragments, so it trains in a continuous loop. Usage loop::

    learner = BCLearner(policy, load_dataset(path), config=BCConfig(lr=1e-3), seed=0)
    for metrics in learner.run(steps=2000, until=lambda m: m["perplexity"] < 1.05, report_every=100):
        log(metrics)                          # means over the last report_every steps, plus counters
    version, weights = learner.published()
    start_from_(ppo_learner, weights)         # PPO fine-tunes from the cloned policy (public APIs only)

or, before the PPO learners are built (what ``shoal train --pretrain.dataset PATH`` wires)::

    policies, fixed = build_policies(config, tree, assignment)
    for pid in set(policies) - fixed:         # each learning policy clones its groups' recorded agents
        pretrain_(policies[pid], dataset, BCConfig(), steps=2000, groups=groups_of(assignment, pid))
    learners = build_learners(config, assignment, policies, fixed)
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Iterator, Mapping, Protocol

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from core.layout import ACTION, ACTION_MASK, ENTROPY, LOG_PROB, MASK, OBSERVATION
from core.losses.bc import BCConfig, bc_loss
from core.policies import GroupPolicy
from core.policies.networks import read_path
from core.specs import groups as tree_groups
from orchestration.checkpoint import flatten_optimizer, restore_optimizer
from orchestration.datasets import Dataset
from orchestration.learner import Done

Until = Callable[[Mapping[str, float]], bool]
"""A stop condition, read with each report's metrics (a loss threshold, a deadline, an event)."""


class StreamLearner(Protocol):
    """A learner that trains in a loop on data it pulls itself (a static dataset, a stream); module docstring."""

    def train_step(self) -> Mapping[str, torch.Tensor]:
        """One gradient step; detached 0-d tensors (no host sync needed)."""
        ...

    def run(self, steps: int | None = None, until: Until | None = None, *,
            report_every: int = 100) -> Iterator[dict[str, float]]:
        """Trains until ``steps`` steps or ``until``; yields metrics every ``report_every`` steps
        (:func:`run_steps`)."""
        ...

    def published(self) -> tuple[int, TensorDictBase]: ...

    def state(self) -> dict[str, Any]: ...

    def load_state_(self, state: Mapping[str, Any]) -> None: ...

    def report(self) -> dict[str, Any]: ...


def run_steps(train_step: Callable[[], Mapping[str, torch.Tensor]], *, steps: int | None = None,
              until: Until | None = None, report_every: int = 100,
              counters: Callable[[], Mapping[str, float]] | None = None) -> Iterator[dict[str, float]]:
    """The continuous training loop: calls ``train_step`` until ``steps`` calls or ``until`` says stop.

    A generator: nothing trains until it is iterated (``*_, last = run_steps(...)`` runs it to the end). Every
    ``report_every`` steps, and after the last step of the budget, it yields the means of ``train_step``'s
    outputs since the previous report (summed as tensors: no host sync per step), ``counters()`` and
    ``run_steps`` (steps taken in this call); ``until(metrics)`` is read there, so it stops at a report.

    Args:
        train_step: one step; returns detached 0-d tensors (or floats).
        steps: the step budget of this call (None: no budget; ``until`` or the consumer stops it).
        until: stop condition read with each report's metrics, or None.
        report_every: steps per report (1: read ``until`` after every step).
        counters: running totals added to each report (versions, epochs, samples).

    Raises:
        ValueError: a negative budget or ``report_every < 1``.
    """
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0 or None, got {steps}")
    if report_every < 1:
        raise ValueError(f"report_every must be >= 1, got {report_every}")
    taken, since, sums = 0, 0, {}
    start = time.perf_counter()
    while steps is None or taken < steps:
        for key, value in train_step().items():
            sums[key] = sums[key] + value if key in sums else value
        taken, since = taken + 1, since + 1
        if since == report_every or taken == steps:
            metrics = {key: float(value) / since for key, value in sums.items()}
            metrics.update(counters() if counters is not None else {})
            metrics.update(run_steps=taken, steps_per_s=taken / max(time.perf_counter() - start, 1e-9))
            sums, since = {}, 0
            stop = until is not None and bool(until(metrics))
            yield metrics
            if stop:
                return


def actor_log_prob(policy: GroupPolicy, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(log pi(a|s), entropy)``, each ``[*B, A, 1]``, of the recorded actions from the actor
    alone (no critic forward): the group entry ``batch`` ``[*B, A]`` holds ``"observation"``, ``"action"`` and
    optionally ``"action_mask"`` (illegal actions get no probability). Same values as
    :meth:`GroupPolicy.evaluate_terms` of a feed-forward policy."""
    features = policy.actor_encoder.encode(batch.get(OBSERVATION))
    params, _ = policy.actor_params(features)
    actions = [read_path(batch, (ACTION, *path)) for path in policy.heads.paths]
    return policy.heads.log_prob_entropy(params, actions, batch.get(ACTION_MASK, None))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _tensor(array) -> torch.Tensor:
    return array.clone() if isinstance(array, torch.Tensor) else torch.from_numpy(np.array(array))


class BCLearner:
    """Pre-trains ``policy`` by behaviour cloning on a static dataset (:func:`core.losses.bc.bc_loss`).

    Each step takes the next minibatch of a per-epoch random permutation of the transitions (every transition
    once per epoch; the agents of a transition stay together), maximises the log-probability of the recorded
    actions of present agents under the recorded action masks, clips the global gradient norm and steps
    Adam; a step whose loss or gradient norm is not finite is skipped (counted). Transitions where none of the
    trained agents is present are dropped up front. Observation normalisers (``normalize_observations``) are
    fitted to the whole dataset once, at construction. Several groups: their losses are summed.

    Args:
        policy: the feed-forward module to train (trained in place: pass a copy to keep the original).
        dataset: the recorded episodes; its tree must hold ``groups``.
        config: loss and optimiser settings.
        groups: group -> bool ``[A]`` slots whose recorded agents are cloned (None: all); None: the policy's
            own group.
        policy_id: names the policy in reports.
        seed: seeds the minibatch order.
        device: where it trains.

    Raises:
        ValueError: a recurrent policy (the dataset has no recurrent state), a group the dataset lacks, or no
            transition where a trained agent is present.
    """

    learns = False  # trains through run() on its dataset, never on fleet fragments (a Trainer treats it as fixed)

    def __init__(self, policy: GroupPolicy, dataset: Dataset, *, config: BCConfig | None = None,
                 groups: Mapping[str, torch.Tensor | None] | None = None, policy_id: str = "policy", seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        if policy.recurrent:
            raise ValueError(f"policy {policy_id!r} is recurrent (--policy.recurrent): behaviour cloning here "
                             f"(--pretrain.dataset) trains feed-forward policies")
        self.config = config if config is not None else BCConfig()
        self.groups = dict(groups) if groups is not None else {policy.group_name: None}
        unknown = set(self.groups) - set(tree_groups(dataset.tree))
        if unknown:
            raise ValueError(f"groups {sorted(unknown)} are not in the dataset's tree "
                             f"(its groups: {sorted(tree_groups(dataset.tree))})")
        self.device = torch.device(device)
        self.policy, self.policy_id, self.dataset = policy.to(self.device), policy_id, dataset
        self.data = self._select(dataset.data).to(self.device)
        self.num_transitions = int(self.data.batch_size[0])
        for g in self.groups:
            self.policy.observe_(self.data.get((g, OBSERVATION)), self.data.get(g).get(MASK, None))
        fused = self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.config.lr, eps=1e-5, fused=fused)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.counters = {"train_steps": 0, "skipped_steps": 0, "samples_trained": 0, "epochs": 0}
        self._order = torch.zeros(0, dtype=torch.int64)
        self._cursor = 0
        self._published = (-1, TensorDict())

    def _select(self, data: TensorDictBase) -> TensorDict:
        """The entries BC reads, agent masks narrowed to the trained slots (an all-True mask is dropped: the
        unmasked loss is cheaper), only transitions where a trained agent is present."""
        n = data.batch_size[0]
        out, keep = TensorDict(batch_size=[n]), torch.zeros(n, dtype=torch.bool)
        for g, slots in self.groups.items():
            src = data.get(g)
            mask = src.get(MASK) if slots is None else src.get(MASK) & slots.to(torch.bool)
            keep |= mask.any(-1)
            entry = src.select(*[k for k in (OBSERVATION, ACTION, ACTION_MASK) if k in src.keys()])
            if not bool(mask.all()):
                entry.set(MASK, mask)
            if ACTION_MASK in entry.keys() and bool(entry.get(ACTION_MASK).all()):
                entry = entry.exclude(ACTION_MASK)
            out.set(g, entry)
        if not bool(keep.any()):
            raise ValueError(f"no transition of the dataset has a present agent of groups {sorted(self.groups)}")
        return out if bool(keep.all()) else out[keep]

    # -- training ----------------------------------------------------------------------------------------
    def _next_indices(self) -> torch.Tensor:
        if self._cursor >= len(self._order):
            self._order = torch.randperm(self.num_transitions, generator=self.generator)
            self._cursor = 0
        idx = self._order[self._cursor:self._cursor + self.config.minibatch_size]
        self._cursor += len(idx)
        if self._cursor >= len(self._order):
            self.counters["epochs"] += 1
        return idx

    def train_step(self) -> dict[str, torch.Tensor]:
        """One gradient step on the next minibatch; detached 0-d tensors: ``loss_bc``, ``loss_entropy``,
        ``perplexity``, ``entropy`` (per group ``<group>/...`` when several), ``grad_norm``, ``skipped``."""
        minibatch = self.data[self._next_indices().to(self.device)]
        total, metrics = None, {}
        for g in self.groups:
            batch = minibatch.get(g)
            log_prob, entropy = actor_log_prob(self.policy, batch)
            out = bc_loss({LOG_PROB: log_prob, ENTROPY: entropy}, self.config, batch.get(MASK, None))
            loss = out["loss_bc"] + out["loss_entropy"]
            total = loss if total is None else total + loss
            metrics.update({f"{g}/{k}" if len(self.groups) > 1 else k: v.detach() for k, v in out.items()})
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        max_norm = self.config.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)
        applied = bool(torch.isfinite(grad_norm) & torch.isfinite(total))  # the one host sync per step
        if applied:
            self.optimizer.step()
            self.version += 1
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.counters["skipped_steps"] += 1
        self.counters["train_steps"] += 1
        self.counters["samples_trained"] += int(minibatch.batch_size[0])
        metrics.update(grad_norm=grad_norm.detach(), skipped=torch.tensor(0.0 if applied else 1.0))
        return metrics

    def run(self, steps: int | None = None, until: Until | None = None, *,
            report_every: int = 100) -> Iterator[dict[str, float]]:
        """Trains ``steps`` gradient steps (None: until stopped) or until ``until(metrics)``; a generator yielding
        a report every ``report_every`` steps and after the last (:func:`run_steps`): the means of
        :meth:`train_step`'s metrics plus ``version``, ``train_steps``, ``epochs`` (fraction of passes over the
        dataset), ``run_steps`` and ``steps_per_s``. ``*_, last = learner.run(steps=500)`` runs to the end."""
        return run_steps(self.train_step, steps=steps, until=until, report_every=report_every,
                         counters=lambda: {"version": self.version, "train_steps": self.counters["train_steps"],
                                           "epochs": self.counters["samples_trained"] / self.num_transitions})

    # -- the Learner protocol ----------------------------------------------------------------------------
    def receive(self, fragment: TensorDictBase, meta: Mapping[str, Any] | None = None) -> None:
        """Fleet fragments are not its data: dropped."""

    def ready(self) -> bool:
        """Never has fleet data to train on."""
        return False

    def submit(self, progress: float = 0.0, lr: float | None = None, take_all: bool = False) -> Done:
        """Nothing to train from a fleet (it trains through :meth:`run`)."""
        return Done(None)

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every parameter group."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def published(self) -> tuple[int, TensorDictBase]:
        """``(version, weights)``: the current weights as a detached CPU copy, never mutated (one copy per
        version, taken when first asked for). The version counts applied gradient steps."""
        if self._published[0] != self.version:
            with torch.no_grad():
                weights = TensorDict.from_module(self.policy)
                weights = weights.clone() if self.device.type == "cpu" else weights.to("cpu")
            self._published = (self.version, weights)
        return self._published

    def weights(self) -> tuple[int, TensorDictBase]:
        """``(version, weights)`` as a local TensorDict (here the same as :meth:`published`)."""
        return self.published()

    def actor_policy(self) -> GroupPolicy:
        """A CPU copy of the policy with the current weights, for an actor or an evaluation."""
        _, weights = self.published()
        policy = copy.deepcopy(self.policy).cpu()
        with torch.no_grad():
            TensorDict.from_module(policy).update_(weights)
        return policy

    def report(self) -> dict[str, Any]:
        """Counters, version and what the dataset holds."""
        return {"learner": dict(self.counters), "version": self.version, "policy": self.policy_id,
                "dataset": {"env": self.dataset.env, "source": self.dataset.source, "steps": self.dataset.steps,
                            "episodes": self.dataset.episodes, "trained_transitions": self.num_transitions}}

    def state(self) -> dict[str, Any]:
        """Weights, optimizer, generator, epoch order and position, version and counters (numpy arrays and JSON
        values, as :meth:`orchestration.learner.PPOLearner.state`): a resumed run takes the same minibatches."""
        opt_tensors, opt_meta = flatten_optimizer("optimizer", self.optimizer)
        return {"weights": {k: _numpy(v) for k, v in self.policy.state_dict().items()},
                "optimizer": ({k: _numpy(v) for k, v in opt_tensors.items()}, opt_meta),
                "generator": _numpy(self.generator.get_state()), "order": _numpy(self._order),
                "cursor": self._cursor, "version": self.version, "counters": dict(self.counters),
                "num_transitions": self.num_transitions}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Loads a :meth:`state` taken on the same dataset (mutates this learner).

        Raises:
            ValueError: the state was taken on a dataset of another size.
        """
        if int(state["num_transitions"]) != self.num_transitions:
            raise ValueError(f"state of a BC learner trained on {state['num_transitions']} transitions; this one "
                             f"has {self.num_transitions}: another dataset")
        self.policy.load_state_dict({k: _tensor(v).to(self.device) for k, v in state["weights"].items()})
        tensors, meta = state["optimizer"]
        restore_optimizer("optimizer", self.optimizer, {k: _tensor(v) for k, v in tensors.items()}, meta)
        self.generator.set_state(_tensor(state["generator"]))
        self._order, self._cursor = _tensor(state["order"]).to(torch.int64), int(state["cursor"])
        self.version = int(state["version"])
        self.counters.update(state["counters"])


def start_from_(learner, weights: TensorDictBase) -> int:
    """Copies pretrained ``weights`` (e.g. :meth:`BCLearner.published`) into a learner's policy (a
    :class:`orchestration.learner.PPOLearner`, or anything with ``policy``, ``version`` and ``publish_as``) and
    republishes them as the next version, so every actor loads them. Mutates ``learner``; its optimizer state
    is kept (a fresh learner has none). Returns the new version.

    Raises:
        ValueError: the weights do not fit the policy (other keys or shapes).
    """
    target = TensorDict.from_module(learner.policy)
    mine, theirs = set(target.keys(True, True)), set(weights.keys(True, True))
    if mine != theirs:
        raise ValueError(f"weights do not fit the policy: keys {sorted(map(str, mine ^ theirs))[:4]} differ")
    wrong = [k for k in mine if target.get(k).shape != weights.get(k).shape]
    if wrong:
        raise ValueError(f"weights do not fit the policy: {wrong[0]} is {tuple(weights.get(wrong[0]).shape)}, "
                         f"the policy's {tuple(target.get(wrong[0]).shape)}")
    with torch.no_grad():
        target.update_(weights.to(next(learner.policy.parameters()).device))
    learner.publish_as(learner.version + 1)
    return learner.version


def pretrain_(policy: GroupPolicy, dataset: Dataset, config: BCConfig | None = None, *, steps: int,
              groups: Mapping[str, torch.Tensor | None] | None = None, until: Until | None = None, seed: int = 0,
              device: str | torch.device = "cpu", report_every: int = 100,
              policy_id: str = "policy") -> list[dict[str, float]]:
    """Behaviour-clones ``dataset`` into ``policy`` in place (:class:`BCLearner` for ``steps`` steps or until
    ``until``), leaving the module on the device it came from; returns the reports.

    The hook for a PPO run: pretrain each learning policy right after
    :func:`orchestration.builder.build_policies`, before the learners and actors copy it (module docstring).
    """
    home = next(policy.parameters()).device
    learner = BCLearner(policy, dataset, config=config, groups=groups, seed=seed, device=device, policy_id=policy_id)
    reports = list(learner.run(steps, until, report_every=report_every))
    policy.to(home)
    return reports


__all__ = ["BCLearner", "StreamLearner", "Until", "actor_log_prob", "pretrain_", "run_steps", "start_from_"]
