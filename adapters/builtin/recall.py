"""Recall: a batched memory task in torch (a cue shown once, acted on ``delay`` steps later).

Every episode draws a cue in ``[0, num_cues)``. The first observation shows it (one-hot); the next
``delay - 1`` observations show nothing; the last one (step ``delay``) raises a query flag. The action at the
query step scores reward 1 if it names the cue, 0 otherwise, and the episode terminates; actions before it do
nothing. Observation ``[num_cues + 1]`` float: the cue one-hot (only at step 0), then the query flag.

A feed-forward policy sees the same observation at every query whatever the cue, so it scores ``1 / num_cues``
on average at best; a policy with memory scores 1. Episodes last ``delay + 1`` steps; a return is a hit (0 or 1).

One agent, group ``"agent"`` (capacity 1), every action legal. Randomness: one ``torch.Generator`` for the
batch (``reset(seed)`` seeds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, DONE, MASK, OBSERVATION, REWARD, TERMINATED, TRUNCATED, all_true
from core.specs import AgentNode, Leaf, Tree, groups

from ._base import BuiltinEnv
from ._tensordicts import assemble_step, reset_output


def recall_tree(num_cues: int = 2) -> Tree:
    """The tree of :class:`Recall`: observation ``[num_cues + 1]`` in [0, 1], ``num_cues`` discrete actions."""
    return AgentNode(observation=Leaf.box((num_cues + 1,), low=0.0, high=1.0), action=Leaf.discrete(num_cues))


@dataclass(frozen=True, kw_only=True, slots=True)
class RecallConfig:
    """Settings of :class:`Recall`."""

    num_envs: int = 64
    """Number of envs stepped together."""
    num_cues: int = 2
    """Distinct cues (and actions), >= 2; chance is ``1 / num_cues``."""
    delay: int = 4
    """Steps from the cue to the query (>= 1): the cue must be remembered over ``delay`` steps."""
    device: str = "cpu"
    """Device of the state and of every output tensor."""

    def __post_init__(self) -> None:
        if self.num_envs < 1 or self.num_cues < 2 or self.delay < 1:
            raise ValueError(f"Recall needs num_envs >= 1, num_cues >= 2 and delay >= 1, got {self.num_envs}, "
                             f"{self.num_cues} and {self.delay}")


class Recall(BuiltinEnv):
    """``num_envs`` Recall tasks stepped together (a :class:`adapters.protocol.BatchedEnv`; module docstring).

    Public state, for tests and tools: ``cue`` ``[env]`` int64 and ``steps`` ``[env]`` int64 (steps taken in
    the episode; the query is shown when ``steps == delay``).
    """

    def __init__(self, config: RecallConfig | None = None) -> None:
        self.config = c = config if config is not None else RecallConfig()
        self._tree = recall_tree(c.num_cues)
        self._group = next(iter(groups(self._tree)))
        self._device = torch.device(c.device)
        self._env_batch, self._group_batch = torch.Size([c.num_envs]), torch.Size([c.num_envs, 1])
        self._generator = torch.Generator(device=self._device)
        self._seeded = False
        self.cue = torch.zeros(c.num_envs, dtype=torch.int64, device=self._device)
        self.steps = torch.zeros(c.num_envs, dtype=torch.int64, device=self._device)
        self._present = all_true(c.num_envs, 1, device=self._device)
        self._legal = all_true(c.num_envs, 1, c.num_cues, device=self._device)

    def _observation(self) -> torch.Tensor:
        """``[E, 1, num_cues + 1]``: the cue one-hot at step 0, the query flag at step ``delay``."""
        c = self.config
        obs = torch.zeros(c.num_envs, c.num_cues + 1, device=self._device)
        first = (self.steps == 0).to(obs.dtype)
        obs[:, : c.num_cues] = torch.nn.functional.one_hot(self.cue, c.num_cues).to(obs.dtype) * first[:, None]
        obs[:, c.num_cues] = (self.steps == c.delay).to(obs.dtype)
        return obs.unsqueeze(1)

    def reset(self, seed: int | None = None) -> TensorDict:
        """New episodes everywhere; ``seed`` seeds the batch's generator (None: continue its stream)."""
        self._seed_(seed)
        self.cue = torch.randint(0, self.config.num_cues, (self.num_envs,), generator=self._generator,
                                 device=self._device)
        self.steps = torch.zeros_like(self.steps)
        return reset_output(self._group, self._root(), self._env_batch, self._group_batch)

    def step(self, actions: TensorDict) -> TensorDict:
        """Scores the ``(agent, action)`` ``[env, 1]`` of envs at their query step; starts their next episode."""
        c = self.config
        action = actions.get((self._group, ACTION)).reshape(self.num_envs)
        query = self.steps == c.delay
        reward = (query & (action == self.cue)).to(torch.float32).view(-1, 1, 1)
        self.steps = self.steps + 1
        final = self._observation()
        self.steps = torch.where(query, torch.zeros_like(self.steps), self.steps)
        fresh = torch.randint(0, c.num_cues, (self.num_envs,), generator=self._generator, device=self._device)
        self.cue = torch.where(query, fresh, self.cue)
        term = query.view(-1, 1)
        trunc = torch.zeros_like(term)
        nxt = {OBSERVATION: final, REWARD: reward, TERMINATED: term.unsqueeze(2), TRUNCATED: trunc.unsqueeze(2),
               DONE: term.unsqueeze(2), MASK: self._present}
        return assemble_step(self._group, self._root(), nxt, (term, trunc, term), self._env_batch, self._group_batch)

    def _root(self) -> dict:
        return {OBSERVATION: self._observation(), MASK: self._present, ACTION_MASK: self._legal}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that decides the future of the batch (checkpoints resume it exactly)."""
        return {"cue": self.cue.clone(), "steps": self.steps.clone(), "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict` output."""
        self.cue = state["cue"].to(self.cue).clone()
        self.steps = state["steps"].to(self.steps).clone()
        self._generator.set_state(state["rng"])
        self._seeded = True

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["Recall", "RecallConfig", "recall_tree"]
