"""The learner's side of reward scaling (``PolicyConfig.scale_rewards``): per-stream discounted returns.

Design. The running variance of the discounted return is the policy's state (persistent buffers of its
:class:`core.policies.reward_scaling.RewardScaler`): it travels with the weights and checkpoints, actors and
evaluators never change it. The discounted return itself needs every reward of a stream in order, with an
accumulator per env row and agent carried across fragments. The learner computes it, over each fragment's
time axis (:func:`core.policies.reward_scaling.discounted_returns`, one vectorised op per step of a fragment),
from fragments it receives: the actor's hot path stays as it is and the actors need neither the discount nor
extra state. :class:`ReturnStreams` holds the accumulators, one ``[E, A]`` per worker stream and group, and
the last sequence number it consumed per worker, so a fragment trained on twice (asynchronous reuse) advances
them once. Returns are computed from whole fragments before a batch is split between data-parallel ranks
(:meth:`ReturnStreams.annotated`), so only the learner that receives them holds accumulators. A fragment dropped
as stale is skipped, and the next one continues from the accumulator as it
was: a small error in a statistic that only sets a scale. The accumulators are part of the learner's state
(and so of checkpoints); like the inbox ledger, they are restored only when the workers' streams resume too.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from core.layout import DONE, FRAGMENT_ID, MASK, NEXT, REWARD, STREAM_RETURNS
from core.policies.reward_scaling import RewardScaler, discounted_returns, with_scaled_rewards

#: ``STREAM_RETURNS``' entry of a group: the discounted return ``[E, T, A]`` float64.
RETURN = "return"


class ReturnStreams:
    """Discounted-return accumulators per worker stream; feeds the returns to a :class:`RewardScaler`.

    Args:
        gamma: the discount of the returns (``PPOConfig.gamma``, the one GAE uses).
        groups: group -> bool ``[A]`` slots the policy acts for (None: all); only their present steps
            (``(group, "mask")``) update the statistics, every agent's accumulator advances.
        scaler: the trained policy's statistics (``GroupPolicy.reward_scaler``).
    """

    def __init__(self, gamma: float, groups: Mapping[str, torch.Tensor | None], scaler: RewardScaler) -> None:
        self.gamma = float(gamma)
        self.groups = dict(groups)
        self.scaler = scaler
        self.carry: dict[tuple[int, str], torch.Tensor] = {}
        """``(worker id, group)`` -> ``[E, A]`` float64 accumulator entering the stream's next fragment."""
        self.sequence: dict[int, int] = {}
        """Worker id -> sequence number of the last fragment consumed."""

    def _returns(self, fragment: TensorDictBase) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Group -> ``(returns [E, T, A] float64, mask [E, T, A])`` of a fragment not consumed before (the rows
        the statistics count: present steps of the policy's slots); advances the accumulators. None for a
        fragment consumed before (asynchronous reuse: its returns are in the statistics already)."""
        fid = int(fragment.get(FRAGMENT_ID).reshape(-1)[0])
        worker, seq = fid >> 32, fid & 0xFFFFFFFF
        if seq <= self.sequence.get(worker, -1):
            return None
        self.sequence[worker] = seq
        out = {}
        for group, slots in self.groups.items():
            g_next = fragment.get((NEXT, group))
            reward = g_next.get(REWARD)
            e, a = reward.shape[0], reward.shape[2]
            carry = self.carry.get((worker, group))
            if carry is None or carry.shape != (e, a):
                carry = torch.zeros(e, a, dtype=torch.float64, device=reward.device)
            returns, self.carry[(worker, group)] = discounted_returns(reward, g_next.get(DONE), self.gamma,
                                                                      carry.to(reward.device))
            mask = fragment.get((group, MASK), None)
            if slots is not None:
                slots = slots.to(returns.device)
                mask = slots.expand(returns.shape) if mask is None else mask & slots
            out[group] = returns, mask
        return out

    def annotated(self, fragment: TensorDictBase) -> TensorDictBase:
        """``fragment`` ``[E, T]`` with its returns under ``STREAM_RETURNS`` (a shallow copy): per group
        ``[E, T, A]``, ``RETURN`` and ``MASK`` (all False for a fragment consumed before). A data-parallel rank 0
        annotates whole fragments before it splits a batch, so each rank counts its shard's rows exactly."""
        found, groups = self._returns(fragment), {}
        for group in self.groups:
            if found is None:  # nothing of it counts
                reward = fragment.get((NEXT, group, REWARD))
                returns = torch.zeros(reward.shape[:3], dtype=torch.float64, device=reward.device)
                mask = torch.zeros(returns.shape, dtype=torch.bool, device=returns.device)
            else:
                returns, mask = found[group]
                mask = torch.ones(returns.shape, dtype=torch.bool, device=returns.device) if mask is None else mask
            groups[group] = TensorDict({RETURN: returns, MASK: mask}, batch_size=returns.shape)
        return fragment.clone(False).set(STREAM_RETURNS, TensorDict(groups, batch_size=fragment.batch_size))

    def observe_(self, fragments: Sequence[TensorDictBase], reduce=None) -> float:
        """Merges the returns of every fragment not consumed before (in list order; a stream's fragments must
        come in sequence order) into the scaler, advancing the accumulators (mutates both); a fragment that holds
        ``STREAM_RETURNS`` (a data-parallel shard, :meth:`annotated`) brings its own. Returns the scale rewards
        are divided by now. ``reduce``: :meth:`RewardScaler.observe_`'s (data-parallel ranks, one shard each)."""
        for fragment in fragments:
            if STREAM_RETURNS in fragment.keys():
                streams = fragment.get(STREAM_RETURNS)
                found = {g: (streams.get((g, RETURN)), streams.get((g, MASK))) for g in self.groups}
            else:
                found = self._returns(fragment)
            for returns, mask in (found or {}).values():
                self.scaler.observe_(returns, mask, reduce)
        return self.scaler.scale()

    def scaled(self, batch: TensorDictBase, group: str) -> TensorDictBase:
        """``batch`` with ``group``'s rewards scaled (a shallow copy, :func:`with_scaled_rewards`)."""
        return with_scaled_rewards(batch, group, self.scaler)

    def state(self) -> dict[str, torch.Tensor]:
        """``carry/<worker>/<group>`` -> accumulator and ``sequence/<worker>`` -> 0-d int64 (copies)."""
        out = {f"carry/{w}/{g}": c.clone() for (w, g), c in self.carry.items()}
        out.update({f"sequence/{w}": torch.tensor(s, dtype=torch.int64) for w, s in self.sequence.items()})
        return out

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state` (values may be numpy arrays); replaces every accumulator."""
        self.carry, self.sequence = {}, {}
        for key, value in state.items():
            kind, rest = key.split("/", 1)
            value = torch.as_tensor(value)
            if kind == "carry":
                worker, group = rest.split("/", 1)
                self.carry[(int(worker), group)] = value.to(torch.float64).clone()
            else:
                self.sequence[int(rest)] = int(value)


__all__ = ["RETURN", "ReturnStreams"]
