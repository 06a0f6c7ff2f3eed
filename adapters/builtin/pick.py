"""Pick: a tiny batched task in torch with a structured action (seed 003's two-stage action, issue 15).

Each step shows every env ``nodes`` nodes. Node ``k`` has features ``[good, available, preferred one-hot (T),
legal (T)]`` (``T = transforms``): exactly one node is *good*; each other node is available with probability
``available_prob`` (the good one always is); each node prefers one transformation and allows each other one
with probability ``legal_prob`` (the preferred one always is legal). The agent acts with a two-stage action,
a non-atomic dict ``{"node": Discrete(nodes), "transform": Discrete(T)}`` whose ``transform`` is conditioned
on ``node`` (:class:`core.specs.DictNode`): it chooses an available node, then a transformation legal *for
that node*. On some steps (probability ``absent_prob``) the env does not execute the transformation: its
presence mask ``("action_mask", "@present", "transform")`` is False and it earns nothing.

Reward: 0 for an unavailable node (never chosen under the masks); else ``[node is good] + [transform executed
and it is the chosen node's preferred one]``. Episodes last ``episode_length`` steps (default 1: a contextual
bandit). With the defaults a random legal policy scores about 0.56 per step, the best one 1.5.

Masks of the step (group ``"agent"``, capacity 1; :mod:`core.specs.structure`)::

    ("agent", "action_mask", "node")                  [E, 1, nodes] bool       available nodes
    ("agent", "action_mask", "transform")             [E, 1, nodes, T] bool    legal transformations per node
    ("agent", "action_mask", "@present", "node")      [E, 1] bool              always True
    ("agent", "action_mask", "@present", "transform") [E, 1] bool              the transformation is executed

Randomness: one ``torch.Generator`` for the batch (``reset(seed)`` seeds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from core.layout import (ACTION, ACTION_MASK, ACTION_PRESENT, DONE, MASK, OBSERVATION, REWARD, TERMINATED,
                         TRUNCATED, all_true)
from core.specs import AgentNode, DictNode, Leaf, Tree, groups

from ._base import BuiltinEnv
from ._tensordicts import assemble_step, fast_td, reset_output


def pick_tree(nodes: int = 4, transforms: int = 3) -> Tree:
    """The tree of :class:`Pick`: ``nodes * (2 + 2 * transforms)`` features in ``[0, 1]``, the two-stage action."""
    action = DictNode({"node": Leaf.discrete(nodes), "transform": Leaf.discrete(transforms)}, atomic=False,
                      conditional={"transform": "node"})
    return AgentNode(observation=Leaf.box((nodes * (2 + 2 * transforms),), low=0.0, high=1.0), action=action)


@dataclass(frozen=True, kw_only=True, slots=True)
class PickConfig:
    """Settings of :class:`Pick`."""

    num_envs: int = 64
    """Number of envs stepped together."""
    nodes: int = 4
    """Nodes to choose from (>= 2)."""
    transforms: int = 3
    """Transformations (>= 2)."""
    available_prob: float = 0.75
    """Probability that a node other than the good one is available."""
    legal_prob: float = 0.5
    """Probability that a transformation other than a node's preferred one is legal for it."""
    absent_prob: float = 0.5
    """Probability that the env skips the transformation at a step."""
    episode_length: int = 1
    """Steps per episode; the episode terminates after the last."""
    device: str = "cpu"
    """Device of the state and of every output tensor."""

    def __post_init__(self) -> None:
        if self.num_envs < 1 or self.episode_length < 1:
            raise ValueError(f"num_envs ({self.num_envs}) and episode_length ({self.episode_length}) must be >= 1")
        if self.nodes < 2 or self.transforms < 2:
            raise ValueError(f"nodes ({self.nodes}) and transforms ({self.transforms}) must be >= 2")
        for name in ("available_prob", "legal_prob", "absent_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


class Pick(BuiltinEnv):
    """``num_envs`` Pick tasks stepped together (a :class:`adapters.protocol.BatchedEnv`; module docstring).

    Public state, for tests and tools (``E`` envs, ``K`` nodes, ``T`` transformations): ``good`` ``[E]`` int64,
    ``preferred`` ``[E, K]`` int64, ``available`` ``[E, K]`` bool, ``legal`` ``[E, K, T]`` bool, ``present``
    ``[E]`` bool (the transformation is executed this step) and ``steps`` ``[E]`` int64.
    """

    def __init__(self, config: PickConfig | None = None) -> None:
        self.config = c = config if config is not None else PickConfig()
        self._tree = pick_tree(c.nodes, c.transforms)
        self._group = next(iter(groups(self._tree)))
        self._device = torch.device(c.device)
        self._env_batch, self._group_batch = torch.Size([c.num_envs]), torch.Size([c.num_envs, 1])
        self._generator = torch.Generator(device=self._device)
        self._seeded = False
        self._present_agent = all_true(c.num_envs, 1, device=self._device)
        self._node_executed = all_true(c.num_envs, 1, device=self._device)
        self._set(self._draw())
        self.steps = torch.zeros(c.num_envs, dtype=torch.int64, device=self._device)

    def _draw(self) -> dict[str, torch.Tensor]:
        """A fresh situation for every env (see the class docstring for the keys)."""
        c, g, dev = self.config, self._generator, self._device
        e, k, t = c.num_envs, c.nodes, c.transforms
        good = torch.randint(0, k, (e,), generator=g, device=dev)
        available = torch.rand(e, k, generator=g, device=dev) < c.available_prob
        available[torch.arange(e, device=dev), good] = True
        preferred = torch.randint(0, t, (e, k), generator=g, device=dev)
        legal = torch.rand(e, k, t, generator=g, device=dev) < c.legal_prob
        legal.scatter_(2, preferred.unsqueeze(-1), True)
        present = torch.rand(e, generator=g, device=dev) >= c.absent_prob
        return {"good": good, "available": available, "preferred": preferred, "legal": legal, "present": present}

    def _set(self, state: dict[str, torch.Tensor]) -> None:
        self.good, self.available, self.preferred = state["good"], state["available"], state["preferred"]
        self.legal, self.present = state["legal"], state["present"]

    def _observation(self) -> torch.Tensor:
        """``[E, 1, K * (2 + 2T)]`` float32 features, node-major."""
        c = self.config
        is_good = torch.nn.functional.one_hot(self.good, c.nodes).unsqueeze(-1)
        preferred = torch.nn.functional.one_hot(self.preferred, c.transforms)
        feats = torch.cat([is_good, self.available.unsqueeze(-1), preferred, self.legal], -1).to(torch.float32)
        return feats.reshape(c.num_envs, 1, -1)

    def _root(self) -> dict:
        e1 = self._group_batch
        present = fast_td({"node": self._node_executed, "transform": self.present.view(-1, 1)}, e1)
        mask = fast_td({"node": self.available.unsqueeze(1), "transform": self.legal.unsqueeze(1),
                        ACTION_PRESENT: present}, e1)
        return {OBSERVATION: self._observation(), MASK: self._present_agent, ACTION_MASK: mask}

    def reset(self, seed: int | None = None) -> TensorDict:
        """New situations everywhere; ``seed`` seeds the batch's generator (None: continue its stream)."""
        self._seed_(seed)
        self._set(self._draw())
        self.steps = torch.zeros_like(self.steps)
        return reset_output(self._group, self._root(), self._env_batch, self._group_batch)

    def rewards(self, node: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
        """``[E]`` float32 reward of ``(node, transform)`` ``[E]`` each, in the current situations."""
        rows = torch.arange(self.num_envs, device=self._device)
        ok = self.available[rows, node]
        hit_node = node == self.good
        hit_transform = self.present & (transform == self.preferred[rows, node]) & self.legal[rows, node, transform]
        return (ok & hit_node).to(torch.float32) + (ok & hit_transform).to(torch.float32)

    def step(self, actions: TensorDict) -> TensorDict:
        """Scores ``(agent, action)`` ``{node, transform}`` ``[env, 1]`` and shows new situations."""
        node = actions.get((self._group, ACTION, "node")).reshape(self.num_envs).long()
        transform = actions.get((self._group, ACTION, "transform")).reshape(self.num_envs).long()
        reward = self.rewards(node, transform).view(-1, 1, 1)
        final = self._observation()
        self.steps = self.steps + 1
        terminated = self.steps >= self.config.episode_length
        self.steps = torch.where(terminated, torch.zeros_like(self.steps), self.steps)
        self._set(self._draw())
        term = terminated.view(-1, 1)
        trunc = torch.zeros_like(term)
        nxt = {OBSERVATION: final, REWARD: reward, TERMINATED: term.unsqueeze(2), TRUNCATED: trunc.unsqueeze(2),
               DONE: term.unsqueeze(2), MASK: self._present_agent}
        return assemble_step(self._group, self._root(), nxt, (term, trunc, term), self._env_batch, self._group_batch)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that decides the future of the batch (checkpoints resume it exactly)."""
        return {"good": self.good.clone(), "available": self.available.clone(), "preferred": self.preferred.clone(),
                "legal": self.legal.clone(), "present": self.present.clone(), "steps": self.steps.clone(),
                "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict` output."""
        self._set({k: state[k].to(self._device).clone()
                   for k in ("good", "available", "preferred", "legal", "present")})
        self.steps = state["steps"].to(self.steps).clone()
        self._generator.set_state(state["rng"])
        self._seeded = True

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["Pick", "PickConfig", "pick_tree"]
