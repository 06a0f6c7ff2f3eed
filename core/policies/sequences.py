"""The recurrent side of :class:`core.policies.GroupPolicy`: cells, the carried state, truncated BPTT on sequences.

A mixin of ``GroupPolicy`` (its methods read the policy's own modules): the actor's and the critic's cells are
unrolled along the time dim of ``[N, W, A]`` sequences (:func:`core.policies.recurrence.unroll`) while the
encoders, trunks and heads run once over all steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from core.layout import RECURRENT_STATE

from .networks import run_layers
from .recurrence import cell_step, unroll


class SequenceEvaluation:
    """Recurrent-state methods of :class:`core.policies.GroupPolicy`: its cells, the carried state's layout, and
    the evaluation of sequences."""

    @property
    def reads_episode_starts(self) -> bool:
        """Whether an actor passes ``episode_start`` to :meth:`act_step` (recurrent policies zero their state)."""
        return self.recurrent

    @property
    def actor_cell(self) -> nn.Module | None:
        """The actor's recurrent cell (None: feed-forward)."""
        return None if self._actor_cell is None else getattr(self, self._actor_cell)

    @property
    def critic_cell(self) -> nn.Module | None:
        """The critic's recurrent cell (None: feed-forward critic)."""
        return None if self._critic_cell is None else getattr(self, self._critic_cell)

    def split_state(self, state: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """``(actor part, critic part)`` of a carried state ``[*B, A, S]`` (None for a part without a cell)."""
        if state is None:
            raise ValueError(f"group {self.group_name}: a recurrent policy needs a recurrent_state [*B, A, "
                             f"{self.state_size}]")
        if state.shape[-1] != self.state_size:
            raise ValueError(f"group {self.group_name}: recurrent_state must end with {self.state_size}, got "
                             f"{tuple(state.shape)}")
        parts = list(state.split(self._state_split, -1))
        actor = parts.pop(0) if self._actor_cell is not None else None
        return actor, (parts.pop(0) if self._critic_cell is not None else None)

    def initial_state(self, batch: Sequence[int]) -> Tensor:
        """Zero state ``[*batch, A, S]`` (``batch`` without the agent dim)."""
        return torch.zeros(*batch, self.num_agents, self.state_size, device=self.actor_out.weight.device)

    def evaluate_sequence(self, batch, shared, start: Tensor) -> dict[str, Tensor]:
        """:meth:`evaluate_terms` over sequences, by truncated BPTT (recurrent policies).

        Args:
            batch: a group entry ``[N, W, A]`` (``N`` sequences of ``W`` steps) with ``"recurrent_state"``
                ``[N, W, A, S]`` (the states the actor used) besides :meth:`evaluate`'s entries.
            shared: the root ``"shared"`` entry ``[N, W, ...]`` (central critic), or None.
            start: bool ``[N, W]``: steps that read the stored state instead of carrying one
                (:func:`core.policies.recurrence.unroll`; column 0 all True).

        Returns:
            ``"log_prob"``, ``"entropy"``, ``"state_value"``, each ``[N, W, A, 1]``, with gradients through the
            carried states.
        """
        x = self._features(batch)
        actor_stored, critic_stored = self.split_state(batch.get(RECURRENT_STATE))
        h = self.actor_hidden(x, shared)
        h, _ = unroll(partial(cell_step, self.actor_cell), h, actor_stored, start)
        return self._terms(batch, self.actor_out.forward(h), self._sequence_values(batch, shared, x, critic_stored,
                                                                                   start)[0])

    def _sequence_values(self, obs, shared, actor_features, stored: Tensor | None, start: Tensor
                         ) -> tuple[Tensor, Tensor | None]:
        """Values ``[N, W, A, 1]`` along sequences and the critic cell's states after each step (None: no cell)."""
        if self.critic_cell is None:
            return self._value(obs, shared, actor_features)
        h = run_layers(self.critic_trunk, self._critic_input(obs, shared, actor_features))
        h, states = unroll(partial(cell_step, self.critic_cell), h, stored, start)
        return self._critic_output(h), states

    @torch.no_grad()
    def sequence_values(self, obs, shared, next_obs, next_shared, start: Tensor) -> tuple[Tensor, Tensor]:
        """Critic values at every observation and every next observation of fragments ``[E, T]``, the critic's
        state carried along time (a recurrent critic; the learner's GAE inputs).

        Args:
            obs, next_obs: group entries ``[E, T, A]`` (``"observation"``, optional ``"mask"``); ``obs`` also holds
                ``"recurrent_state"`` ``[E, T, A, S]``.
            shared, next_shared: root ``"shared"`` entries ``[E, T, ...]`` or None.
            start: bool ``[E, T]`` (:meth:`evaluate_sequence`).

        Returns:
            ``(values, next_values)``, each ``[E, T, A, 1]``: the value of ``next_obs[:, t]`` is taken from the
            state after step ``t`` (the state that observation is seen with, also where the episode ended).
        """
        stored = self.split_state(obs.get(RECURRENT_STATE))[1]
        values, states = self._sequence_values(obs, shared, None, stored, start)
        if states is None:
            return values, self._value(next_obs, next_shared, None)[0]
        return values, self._value(next_obs, next_shared, None, states)[0]


__all__ = ["SequenceEvaluation"]
