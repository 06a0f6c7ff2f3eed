"""Spot: a tiny batched image task in torch ("in which quadrant is the bright pixel?"), for conv policies.

Each step shows every env a fresh ``[C, size, size]`` uint8 image (channels first): background noise uniform in
``[0, noise]`` and one pixel of 255 (all channels) at a uniformly drawn position. The agent answers with one of
4 actions, the quadrant of that pixel (``2 * (row >= size / 2) + (col >= size / 2)``: 0 top-left, 1 top-right,
2 bottom-left, 3 bottom-right), and gets reward 1 for the right quadrant, 0 otherwise. An episode is
``episode_length`` steps (default 1: a contextual bandit, whose return is the hit rate); then it terminates.
Random play scores 0.25 per step; a policy that reads the image scores 1.

One agent, group ``"agent"`` (capacity 1), every action legal. The images are recognised as images by the
policy (:func:`core.policies.networks.image_layout`: 1 or 3 channels first, sides >= 8) and reach its CNN
as bytes. Randomness: one ``torch.Generator`` for the batch (``reset(seed)`` seeds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, DONE, MASK, OBSERVATION, REWARD, TERMINATED, TRUNCATED, all_true
from core.specs import AgentNode, Leaf, Tree, groups

from ._base import BuiltinEnv
from ._tensordicts import assemble_step, reset_output


def spot_tree(size: int = 12, channels: int = 1) -> Tree:
    """The tree of :class:`Spot`: a ``[channels, size, size]`` uint8 image, 4 discrete actions."""
    return AgentNode(observation=Leaf.box((channels, size, size), low=0, high=255, dtype=torch.uint8),
                     action=Leaf.discrete(4))


@dataclass(frozen=True, kw_only=True, slots=True)
class SpotConfig:
    """Settings of :class:`Spot`."""

    num_envs: int = 64
    """Number of envs stepped together."""
    size: int = 12
    """Side of the square image in pixels (even, >= 8: the policy's image encoders need sides >= 8)."""
    channels: int = 1
    """Image channels, 1 (grey) or 3 (RGB); the spot is 255 in every channel."""
    noise: int = 64
    """Background pixels are uniform in ``[0, noise]`` (0: a black background); below 255, so the spot stands out."""
    episode_length: int = 1
    """Steps per episode (each shows a new spot); the episode terminates after the last."""
    device: str = "cpu"
    """Device of the state and of every output tensor."""

    def __post_init__(self) -> None:
        if self.num_envs < 1 or self.episode_length < 1:
            raise ValueError(f"num_envs ({self.num_envs}) and episode_length ({self.episode_length}) must be >= 1")
        if self.size < 8 or self.size % 2:
            raise ValueError(f"size must be even and >= 8, got {self.size}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if not 0 <= self.noise < 255:
            raise ValueError(f"noise must be in [0, 254], got {self.noise}")


class Spot(BuiltinEnv):
    """``num_envs`` Spot tasks stepped together (a :class:`adapters.protocol.BatchedEnv`; module docstring).

    Public state, for tests and tools: ``image`` ``[env, C, size, size]`` uint8 (what the agent sees now),
    ``target`` ``[env]`` int64 (the right answer) and ``steps`` ``[env]`` int64 (steps taken in the episode).
    """

    def __init__(self, config: SpotConfig | None = None) -> None:
        self.config = c = config if config is not None else SpotConfig()
        self._tree = spot_tree(c.size, c.channels)
        self._group = next(iter(groups(self._tree)))
        self._device = torch.device(c.device)
        self._env_batch, self._group_batch = torch.Size([c.num_envs]), torch.Size([c.num_envs, 1])
        self._generator = torch.Generator(device=self._device)
        self._seeded = False
        self.image = torch.zeros(c.num_envs, c.channels, c.size, c.size, dtype=torch.uint8, device=self._device)
        self.target = torch.zeros(c.num_envs, dtype=torch.int64, device=self._device)
        self.steps = torch.zeros(c.num_envs, dtype=torch.int64, device=self._device)
        self._present = all_true(c.num_envs, 1, device=self._device)
        self._legal = all_true(c.num_envs, 1, 4, device=self._device)

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``(image [E, C, S, S] uint8, target [E] int64)`` for every env."""
        c, g = self.config, self._generator
        n, s = c.num_envs, c.size
        image = torch.randint(0, c.noise + 1, (n, c.channels, s, s), generator=g, device=self._device,
                              dtype=torch.uint8)
        cell = torch.randint(0, s * s, (n,), generator=g, device=self._device)
        row, col = cell // s, cell % s
        image.view(n, c.channels, s * s).scatter_(2, cell.view(n, 1, 1).expand(n, c.channels, 1), 255)
        target = 2 * (row >= s // 2).long() + (col >= s // 2).long()
        return image, target

    def reset(self, seed: int | None = None) -> TensorDict:
        """New spots everywhere; ``seed`` seeds the batch's generator (None: continue its stream)."""
        self._seed_(seed)
        self.image, self.target = self._draw()
        self.steps = torch.zeros_like(self.steps)
        return reset_output(self._group, self._root(), self._env_batch, self._group_batch)

    def step(self, actions: TensorDict) -> TensorDict:
        """Scores ``(agent, action)`` ``[env, 1]`` against the current spots and shows new ones."""
        action = actions.get((self._group, ACTION)).reshape(self.num_envs)
        reward = (action == self.target).to(torch.float32).view(-1, 1, 1)
        final = self.image
        self.steps = self.steps + 1
        terminated = self.steps >= self.config.episode_length
        self.steps = torch.where(terminated, torch.zeros_like(self.steps), self.steps)
        self.image, self.target = self._draw()
        term = terminated.view(-1, 1)
        trunc = torch.zeros_like(term)
        nxt = {OBSERVATION: final.unsqueeze(1), REWARD: reward, TERMINATED: term.unsqueeze(2),
               TRUNCATED: trunc.unsqueeze(2), DONE: term.unsqueeze(2), MASK: self._present}
        return assemble_step(self._group, self._root(), nxt, (term, trunc, term), self._env_batch, self._group_batch)

    def _root(self) -> dict:
        return {OBSERVATION: self.image.unsqueeze(1), MASK: self._present, ACTION_MASK: self._legal}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that decides the future of the batch (checkpoints resume it exactly)."""
        return {"image": self.image.clone(), "target": self.target.clone(), "steps": self.steps.clone(),
                "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict` output."""
        self.image = state["image"].to(self.image).clone()
        self.target = state["target"].to(self.target).clone()
        self.steps = state["steps"].to(self.steps).clone()
        self._generator.set_state(state["rng"])
        self._seeded = True

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["Spot", "SpotConfig", "spot_tree"]
