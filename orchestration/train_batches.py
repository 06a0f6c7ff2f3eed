"""From a learner's ``[E, T]`` batch (GAE inputs) to what :func:`core.losses.ppo_update_` trains on.

- :func:`with_values`: the critic's values at every observation and next observation, the GAE inputs. A
  feed-forward critic evaluates them in a few batched calls; a recurrent critic carries its state along time
  (:meth:`core.policies.GroupPolicy.sequence_values`).
- Team values (:mod:`orchestration.team_critic`): :func:`team_values_for` lines a team critic's values up with
  a batch's fragments; :func:`with_values` then takes them instead of the policy's critic, and
  :func:`update_inputs` turns the policy's own value loss off for those groups.
- :func:`marked_fresh`, :func:`without_marks`, :func:`counted_rows`: the rows running statistics count (a
  fragment reused in later batches counts once).
- :func:`with_advantages`: GAE, or V-trace (``--ppo.advantage vtrace``) with the current policy's log-probabilities.
- :func:`update_inputs`: a feed-forward policy trains on shuffled transitions ``[N]``; a recurrent one on
  whole sequences ``[S]`` (groups ``[S, W, A]``, :func:`core.buffers.split_sequences`), minibatches of
  ``minibatch_size // sequence_length`` sequences, evaluated by truncated BPTT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from core.buffers import drop_trivial_masks, flatten_transitions, sequence_starts, split_sequences
from core.layout import (CRITIC_MASK, EPISODE_ID, FRESH, LOG_PROB, MASK, NEXT, OBSERVATION, RECURRENT_STATE,
                         SEQUENCE_START, SHARED, STATE_VALUE, STREAM_RETURNS)
from core.losses import PPOConfig, with_gae, with_vtrace
from core.policies import GroupPolicy

#: Transitions per critic call when values are computed for a whole batch: the hidden activations of a large
#: batch (64 floats per layer and transition) would otherwise outweigh the batch itself. Small enough that the
#: activations of one call stay far below a 1,024-env batch (``benchmarks/transition_memory.py``: calls of
#: 4,096 transitions added about 35 bytes per transition to the peak of a 1,024-env x 64-step iteration).
VALUE_CHUNK = 1 << 10


def marked_fresh(fragment: TensorDictBase, fresh: bool) -> TensorDictBase:
    """A shallow copy of ``fragment`` ``[E, T]`` with ``FRESH`` ``[E, T]``: whether it is trained for the first
    time (:func:`counted_rows`)."""
    return fragment.clone(False).set(FRESH, torch.full(fragment.batch_size, fresh, device=fragment.device))


def without_marks(batch: TensorDictBase) -> tuple[TensorDictBase, torch.Tensor | None]:
    """``batch`` ``[N, T]`` without the learner's marks (``FRESH``; ``STREAM_RETURNS``, read from the fragments by
    :class:`orchestration.reward_scaling.ReturnStreams`), and ``FRESH`` ``[N, T]`` (None where absent)."""
    fresh = batch.get(FRESH, None)
    if fresh is None and STREAM_RETURNS not in batch.keys():
        return batch, None
    return batch.exclude(FRESH, STREAM_RETURNS), fresh


def counted_rows(entry: TensorDictBase, slots: torch.Tensor | None, fresh: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor | None:
    """Bool ``[E, T, A]``: the rows of a group's ``entry`` ``[E, T, A]`` that running statistics count: present
    (``MASK``), in the policy's ``slots`` ``[A]`` and first trained now (``fresh`` ``[E, T]``: a fragment reused
    in a later batch counts once), on ``device``. None: every row."""
    mask = entry.get(MASK, None)
    for rows in (slots, None if fresh is None else fresh.unsqueeze(-1)):
        if rows is not None:
            ones = torch.ones(entry.batch_size, dtype=torch.bool, device=device)
            mask = (ones if mask is None else mask) & rows.to(device)
    return mask


def team_values_for(values: Mapping[int, TensorDictBase] | None, fragment_ids: Sequence[int],
                    policy_id: str) -> list[TensorDictBase] | None:
    """A team critic's ``values`` (fragment id -> ``[E_i, T]`` values) in the order of ``fragment_ids``.

    Raises:
        RuntimeError: a fragment the critic gave no values for (it must see every fragment the members do).
    """
    if values is None:
        return None
    missing = [f for f in fragment_ids if f not in values]
    if missing:
        raise RuntimeError(f"policy {policy_id!r}: the team critic gave no values for fragments {missing[:5]} of "
                           f"its batch (it has {len(values)}); both must receive every fragment of the iteration")
    return [values[f] for f in fragment_ids]


def with_values(policy: GroupPolicy, batch: TensorDictBase, group: str,
                team: TensorDictBase | None = None) -> TensorDictBase:
    """Adds ``(group, "state_value")`` (unless the actor recorded them and the critic is feed-forward) and
    ``("next", group, "state_value")`` to ``batch`` ``[E, T]`` (in place; returns it). ``team``: a team
    critic's values ``[E, T]`` (both keys); where it has ``group``, they are taken instead of the policy's."""
    if team is not None and group in team.keys():
        for root, values in ((batch, team), (batch.get(NEXT), team.get(NEXT))):
            root.get(group).set(STATE_VALUE, values.get((group, STATE_VALUE)))
        return batch
    if policy.critic_cell is not None:
        return _recurrent_values(policy, batch, group)
    for root in (batch, batch.get(NEXT)):
        g = root.get(group)
        if root is batch and STATE_VALUE in g.keys():
            continue
        obs, shared = _critic_inputs(g), root.get(SHARED, None)
        rows = max(1, VALUE_CHUNK // max(1, g.batch_size[1:].numel()))  # env rows per critic call
        g.set(STATE_VALUE, policy.value(obs, shared) if g.batch_size[0] <= rows else _chunked_values(
            policy, obs, shared, rows))
    return batch


def with_advantages(policy: GroupPolicy, batch: TensorDictBase, group: str, ppo: PPOConfig) -> TensorDictBase:
    """``(group, "advantage")`` and ``(group, "value_target")`` of ``batch`` ``[E, T]`` (with values) by the
    estimator ``ppo.advantage``: GAE, or V-trace with the log-probabilities of the recorded actions under
    ``policy`` as it is now (feed-forward), evaluated :data:`VALUE_CHUNK` transitions at a time, which then
    replace the behaviour's ``(group, "log_prob")`` as PPO's reference (decoupled PPO)."""
    if ppo.advantage == "gae":
        return with_gae(batch, group, ppo.gamma, ppo.gae_lambda)
    g, shared = batch.get(group), batch.get(SHARED, None)
    rows = max(1, VALUE_CHUNK // max(1, g.batch_size[1:].numel()))
    target = torch.cat([policy.evaluate_terms(g[i:i + rows], None if shared is None else shared[i:i + rows])[LOG_PROB]
                        for i in range(0, g.batch_size[0], rows)])
    batch = with_vtrace(batch, group, ppo.gamma, target_log_prob=target)
    # PPO's ratio is then taken against the policy as the update starts (decoupled PPO, Hilton et al. 2021): the
    # behaviour policy's correction is V-trace's truncated rho inside the advantage. Against the behaviour policy
    # again, an off-policy sample would weigh rho * pi / mu (rho squared, or unbounded where the clip lets it be).
    batch.get(group).set(LOG_PROB, target)
    return batch


def _chunked_values(policy: GroupPolicy, obs: TensorDict, shared, rows: int) -> torch.Tensor:
    """``policy.value`` over ``obs`` ``[E, ...]`` ``rows`` env rows at a time, each chunk's values written into
    one output at once: a list of chunk outputs to concatenate would sit in the blocks the chunks' activations
    freed, so that the next chunk's no longer fit there (the heap grew by one chunk's activations per chunk:
    260 MB at 16,384 envs x 64 steps)."""
    n, out = obs.batch_size[0], None
    for i in range(0, n, rows):
        value = policy.value(obs[i:i + rows], None if shared is None else shared[i:i + rows])
        if out is None:
            out = value.new_empty((n, *value.shape[1:]))
        out[i:i + value.shape[0]] = value
    return out


def only_slots(batch: TensorDictBase, group: str, slots: torch.Tensor | None) -> TensorDictBase:
    """``batch`` (``[E, T]``, not modified) with ``(group, "mask")`` narrowed to ``slots`` (``[A]`` bool: the agents
    of ``group`` one policy trains, when the group is split between policies; None: all). The agents present stay
    at ``(group, "critic_mask")``: a central or joint critic reads every present agent of the group at each step,
    as it does at each next step, whose mask is not narrowed (GAE and the loss read only the root mask)."""
    if slots is None:
        return batch
    g = batch.get(group).copy()
    present = g.get(MASK)
    g.set(CRITIC_MASK, present)
    return batch.copy().set(group, g.set(MASK, present & slots.to(present.device)))


def _critic_inputs(g: TensorDictBase, *extra: str) -> TensorDict:
    keys = [k for k in (OBSERVATION, MASK, CRITIC_MASK, *extra) if k in g.keys()]
    return TensorDict({k: g.get(k) for k in keys}, batch_size=g.batch_size)


def _recurrent_values(policy: GroupPolicy, batch: TensorDictBase, group: str) -> TensorDictBase:
    nxt = batch.get(NEXT)
    values, next_values = policy.sequence_values(
        _critic_inputs(batch.get(group), RECURRENT_STATE), batch.get(SHARED, None),
        _critic_inputs(nxt.get(group)), nxt.get(SHARED, None), sequence_starts(batch.get(EPISODE_ID)))
    batch.get(group).set(STATE_VALUE, values)
    nxt.get(group).set(STATE_VALUE, next_values)
    return batch


def update_inputs(policy: GroupPolicy, batch: TensorDictBase, group: str, ppo: PPOConfig,
                  team: TensorDictBase | None = None
                  ) -> tuple[TensorDictBase, Callable[[TensorDictBase], Mapping[str, torch.Tensor]], PPOConfig]:
    """``(data, evaluate, config)`` for ``ppo_update_(policy, optimizer, data, evaluate, config, ...)``.

    Args:
        policy: the trained policy.
        batch: ``[E, T]`` with advantages and value targets of ``group``.
        group: the group trained.
        ppo: the learner's PPO settings (``sequence_length`` and ``burn_in`` shape a recurrent policy's data).
        team: a team critic's values (:func:`with_values`): where it has ``group`` the policy's own critic is
            not trained (``value_coef`` 0; the team critic trains itself).
    """
    if team is not None and group in team.keys():
        ppo = dataclasses.replace(ppo, value_coef=0.0)
    if not policy.recurrent:
        def evaluate(mb):
            return policy.evaluate_terms(mb.get(group), mb.get(SHARED, None))

        return drop_trivial_masks(flatten_transitions(batch), group), evaluate, ppo
    length = min(ppo.sequence_length or batch.batch_size[1], batch.batch_size[1])
    sequences = split_sequences(batch.exclude(NEXT), length, ppo.burn_in, group)

    def evaluate_sequences(mb):
        return policy.evaluate_sequence(mb.get(group), mb.get(SHARED, None), mb.get(SEQUENCE_START))

    config = dataclasses.replace(ppo, minibatch_size=max(1, ppo.minibatch_size // length))
    return drop_trivial_masks(sequences, group), evaluate_sequences, config


__all__ = ["VALUE_CHUNK", "only_slots", "team_values_for", "update_inputs", "with_advantages", "with_values"]
