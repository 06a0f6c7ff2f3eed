"""The learner's curiosity bonus: random network distillation (RND) networks, optimizer and statistics.

:class:`Curiosity` belongs to one :class:`orchestration.learner.PPOLearner` (one policy: its groups share one
observation space, so they share one target and one predictor). Each training batch, before reward scaling and
GAE, :meth:`Curiosity.add_bonus_` (the math is :mod:`core.losses.rnd`):

1. merges the batch's next observations of present agents into the running observation statistics;
2. computes the prediction error of every next observation, merges its non-episodic discounted returns into
   the running return statistics, and adds ``coef * error / std(returns)`` to ``("next", group, "reward")``
   (present agents only; absent ones keep their reward);
3. trains the predictor ``epochs`` Adam steps on a random ``proportion`` of the present samples.

Simplifications against the paper, stated: the bonus joins the extrinsic reward (one value head, one discount)
instead of a second value head; the intrinsic returns restart at each batch (their accumulators are not
carried across fragments, so the scale comes from returns at most a batch long); the observation statistics
start empty instead of from random-policy warm-up steps. Vector observations only (box or binary leaves of at
most one dimension); others raise naming the group and the leaf.

State (:meth:`Curiosity.state`) is a flat dict of CPU tensors (safetensors-friendly): both networks, the
optimizer's tensors, the statistics and the generator; loading it makes a resumed run exact.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from core.layout import MASK, NEXT, OBSERVATION, REWARD
from core.losses import (intrinsic_returns, merged_observation_moments, normalized_observation, prediction_error,
                         rnd_loss, scaled_intrinsic_reward)
from core.policies.networks import init_linear_, mlp, read_path
from core.policies.reward_scaling import merge_moments
from orchestration.checkpoint import flatten_optimizer, restore_optimizer
from orchestration.config import CuriosityConfig

#: State keys of the running statistics, in :meth:`Curiosity.state`.
_STATS = ("obs_mean", "obs_var", "obs_count", "return_mean", "return_var", "return_count")


def _network(in_features: int, hidden: Sequence[int], features: int) -> nn.Sequential:
    """``Linear -> ReLU`` per hidden width, then a linear map to ``features`` (orthogonal, gain sqrt 2)."""
    trunk = mlp(in_features, hidden, "relu", math.sqrt(2))
    return nn.Sequential(*trunk, init_linear_(nn.Linear(hidden[-1], features), math.sqrt(2)))


class Curiosity:
    """RND for one policy's groups.

    Args:
        config: the bonus's settings (enabled: ``coef > 0``).
        paths: key paths of the observation leaves fed to the networks (``()`` for a bare leaf).
        leaves: the :class:`core.specs.Leaf` of each path: box or binary, at most 1-D.
        groups: the groups whose rewards get the bonus (metric names carry the group when there are several).
        name: what errors call the observation (e.g. ``"group agents"``).
        seed: seeds the networks' initial weights and the generator that picks training samples.
        device: where the networks train.

    Raises:
        ValueError: a leaf that is not a vector (an image, a discrete index), named with its path.
    """

    def __init__(self, config: CuriosityConfig, paths: Sequence[tuple[str, ...]], leaves: Sequence,
                 *, groups: Sequence[str], name: str, seed: int = 0, device: str | torch.device = "cpu") -> None:
        for path, leaf in zip(paths, leaves):
            if leaf.kind not in ("box", "binary") or len(leaf.shape) > 1:
                where = f"{name}: observation" + "".join("/" + p for p in path)
                raise ValueError(f"{where} is a {leaf.kind} leaf of shape {leaf.shape}: the curiosity bonus "
                                 f"(--curiosity.coef) supports vector observations only (box or binary leaves of at "
                                 f"most one dimension); train without it or flatten that observation")
        self.config, self.paths, self.groups = config, list(paths), list(groups)
        self._scalar = [leaf.shape == () for leaf in leaves]
        self.device = torch.device(device)
        width = sum(math.prod(leaf.shape) for leaf in leaves)
        h = config.hidden_size
        with torch.random.fork_rng(devices=[]):  # the initial weights are a function of the seed alone
            torch.manual_seed(seed)
            self.target = _network(width, (h, h), config.features).to(self.device).requires_grad_(False)
            self.predictor = _network(width, (h, h, h), config.features).to(self.device)
        self.optimizer = torch.optim.Adam(self.predictor.parameters(), lr=config.lr)
        self.generator = torch.Generator().manual_seed(seed + 0x52D)
        f64 = {"dtype": torch.float64, "device": self.device}
        self.stats = {"obs_mean": torch.zeros(width, **f64), "obs_var": torch.ones(width, **f64),
                      "obs_count": torch.zeros((), **f64), "return_mean": torch.zeros((), **f64),
                      "return_var": torch.ones((), **f64), "return_count": torch.zeros((), **f64)}
        """Running statistics: observations ``[D]`` per feature, intrinsic returns 0-d (float64)."""

    def _vector(self, observation) -> Tensor:
        """The fed leaves of ``observation`` flattened and concatenated: ``[*B, A, D]`` float."""
        parts = [read_path(observation, path).to(torch.float32) for path in self.paths]
        parts = [x.unsqueeze(-1) if scalar else x for x, scalar in zip(parts, self._scalar)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def add_bonus_(self, batch: TensorDictBase, group: str, slots: Tensor | None,
                   metrics: dict[str, float], fresh: Tensor | None = None) -> TensorDictBase:
        """``batch`` with ``coef`` times the scaled RND error of each next observation added to ``group``'s
        rewards; updates the statistics and trains the predictor (mutates this object) and writes
        ``curiosity/*`` entries into ``metrics`` (mutates it). Works with or without autograd enabled.

        Args:
            batch: ``[E, T]`` training batch; ``(NEXT, group, "observation")`` ``[E, T, A, D]`` (leaves as the
                spec says), ``(NEXT, group, "reward")`` ``[E, T, A, 1]``, optional ``(group, "mask")`` ``[E, T, A]``.
            group: the group whose rewards get the bonus.
            slots: bool ``[A]`` slots this policy acts for (None: all): only they get a bonus and train it.
            metrics: the update's metrics.
            fresh: bool ``[E, T]``, rows first trained now: the running statistics count only them (a fragment
                reused in later batches counts once); None: every row.

        Returns:
            A shallow copy of ``batch`` with a new ``(NEXT, group, "reward")`` (the input is not modified).
        """
        cfg, s = self.config, self.stats
        g_next = batch.get((NEXT, group))
        obs = self._vector(g_next.get(OBSERVATION)).to(self.device)               # [E, T, A, D]
        mask = batch.get(group).get(MASK, None)
        mask = torch.ones(obs.shape[:-1], dtype=torch.bool, device=self.device) if mask is None else mask
        if slots is not None:
            mask = mask & slots.to(mask.device)
        counted = mask if fresh is None else mask & fresh.to(mask.device).unsqueeze(-1)
        with torch.no_grad():
            s["obs_mean"], s["obs_var"], s["obs_count"] = merged_observation_moments(
                s["obs_mean"], s["obs_var"], s["obs_count"], obs, counted)
            x = normalized_observation(obs, s["obs_mean"], s["obs_var"])
            target = self.target(x)
            error = torch.where(mask.unsqueeze(-1), prediction_error(self.predictor(x), target), 0.0)
            carry = torch.zeros(error.shape[0], error.shape[2], dtype=torch.float64, device=error.device)
            returns, _ = intrinsic_returns(error, cfg.gamma, carry)                    # [E, T, A]
            s["return_mean"], s["return_var"], s["return_count"] = merge_moments(
                s["return_mean"], s["return_var"], s["return_count"], returns[counted])
            bonus = scaled_intrinsic_reward(error, s["return_var"])                   # [E, T, A, 1]
            reward = g_next.get(REWARD)
            rewarded = reward + (cfg.coef * bonus).to(reward)
            shown = mask.sum().clamp(min=1)
        loss = self._train_(x.reshape(-1, x.shape[-1]), target.reshape(-1, target.shape[-1]), mask.reshape(-1))
        prefix = f"{group}/curiosity/" if len(self.groups) > 1 else "curiosity/"
        metrics.update({f"{prefix}intrinsic_reward": float(bonus.sum() / shown),
                        f"{prefix}prediction_error": float(error.sum() / shown),
                        f"{prefix}predictor_loss": loss, f"{prefix}return_std": float(s["return_var"].sqrt())})
        g_next = g_next.copy().set(REWARD, rewarded)
        nxt = batch.get(NEXT).copy().set(group, g_next)
        return batch.copy().set(NEXT, nxt)

    def _train_(self, x: Tensor, target: Tensor, mask: Tensor) -> float:
        """``epochs`` Adam steps of the predictor on ``x`` ``[N, D]`` towards ``target`` ``[N, K]`` where ``mask``
        ``[N]``; returns the last loss."""
        loss = torch.zeros(())
        with torch.enable_grad():
            for _ in range(self.config.epochs):
                terms = rnd_loss(self.predictor(x), target, mask, self.config.proportion, self.generator)
                loss = terms["loss_predictor"]
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        return float(loss.detach())

    def error(self, observation) -> Tensor:
        """The unscaled prediction error ``[*B, A, 1]`` of ``observation`` ``[*B, A, ...]`` under the current
        statistics (a diagnostic: no state changes)."""
        with torch.no_grad():
            x = normalized_observation(self._vector(observation).to(self.device), self.stats["obs_mean"],
                                       self.stats["obs_var"])
            return prediction_error(self.predictor(x), self.target(x))

    # -- state -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """Flat CPU tensor copies: ``target/*``, ``predictor/*``, ``optimizer/state/*``, the statistics and
        ``generator``."""
        out = {f"target/{k}": v for k, v in self.target.state_dict().items()}
        out.update({f"predictor/{k}": v for k, v in self.predictor.state_dict().items()})
        out.update(flatten_optimizer("optimizer", self.optimizer)[0])
        out.update(self.stats)
        out["generator"] = self.generator.get_state()
        return {k: v.detach().cpu().clone() for k, v in out.items()}

    def load_state_(self, state: Mapping[str, object]) -> None:
        """Inverse of :meth:`state` (values may be numpy arrays); mutates this object."""
        state = {k: torch.as_tensor(v) for k, v in state.items()}
        for name, net in (("target", self.target), ("predictor", self.predictor)):
            net.load_state_dict({k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + "/")})
        meta = {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]}
        restore_optimizer("optimizer", self.optimizer, {k: v for k, v in state.items() if k.startswith("optimizer/")},
                          meta)  # Adam's load_state_dict moves its moments to the parameters' device
        self.stats = {k: state[k].to(torch.float64).to(self.device).clone() for k in _STATS}
        self.generator.set_state(state["generator"].clone())


def curiosity_for(config: CuriosityConfig | None, policy, groups: Sequence[str], *, seed: int,
                  device: str | torch.device) -> Curiosity | None:
    """The :class:`Curiosity` of a learner training ``policy`` (a :class:`core.policies.GroupPolicy`) on
    ``groups``, fed the leaves its actor sees; None when ``config`` is None or off."""
    if config is None or not config.enabled:
        return None
    encoder = policy.actor_encoder
    return Curiosity(config, encoder.paths, encoder.leaves, groups=groups, name=f"group {policy.group_name}",
                     seed=seed, device=device)


__all__ = ["Curiosity", "CuriosityConfig", "curiosity_for"]
