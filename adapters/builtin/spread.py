"""A cooperative multi-agent navigation task in torch whose agents come and go (an array population).

Each env has ``capacity`` agent slots and as many landmarks; slot ``i``'s agent must reach landmark ``i``.
An episode starts with a random number of active agents in ``[min_agents, max_agents]`` (a random subset of
the slots); every other slot *waits* and joins with probability ``join_prob`` per step (at once when nobody
is left). An agent that comes within ``finish_radius`` of its landmark *leaves*: ``terminated`` at that step,
absent (``mask`` False) afterwards, never back in the same episode (PettingZoo's rule). The episode ends
``terminated`` when no agent is left, ``truncated`` after ``max_steps``.

Movement follows MPE: 5 discrete actions (no-op, -x, +x, -y, +y), ``vel = vel * (1 - damping) + accel * dt``,
``pos += vel * dt``, positions clamped to ``[-1, 1]``. Reward of a present agent:
``-distance_coef * distance_to_landmark + arrival_bonus * arrived`` (with ``shared_reward`` every present agent
gets the team mean instead). Absent agents get zeros everywhere (observation, reward, flags).

Per-agent observation ``[6 + 3 * (capacity - 1)]``: own position, velocity, landmark minus position, then for
every other slot its position relative to ours and a presence bit (zeros when absent). The shared observation
(``eval_only``, for a centralised critic) is ``[capacity * 7]``: positions, velocities, landmarks, presence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, DONE, MASK, OBSERVATION, REWARD, TERMINATED, TRUNCATED, all_true
from core.specs import AgentNode, ArrayPopulation, Leaf, Tree, groups

from ._base import BuiltinEnv
from ._tensordicts import assemble_step, reset_output

DAMPING = 0.5
ACCEL = 5.0
DT = 0.1
WAITING, ACTIVE, GONE = 0, 1, 2
_DIRECTIONS = ((0.0, 0.0), (-1.0, 0.0), (1.0, 0.0), (0.0, -1.0), (0.0, 1.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class SpreadConfig:
    """Settings of :class:`Spread`."""

    num_envs: int = 256
    """Number of envs stepped together."""
    capacity: int = 4
    """Agent slots (and landmarks) per env: the agent dim of the group."""
    min_agents: int = 1
    """Fewest agents active at the start of an episode."""
    max_agents: int | None = None
    """Most agents active at the start of an episode (None: ``capacity``)."""
    join_prob: float = 0.02
    """Per-step probability that a waiting slot's agent joins."""
    max_steps: int = 50
    """Episode length after which the episode is truncated."""
    finish_radius: float = 0.1
    """Distance to the landmark at which an agent has arrived and leaves."""
    distance_coef: float = 0.1
    """Weight of the (negative) distance to the landmark in the per-step reward."""
    arrival_bonus: float = 1.0
    """Reward of the step at which an agent arrives."""
    shared_reward: bool = False
    """Give every present agent the mean reward of the present agents (a team reward)."""
    device: str = "cpu"
    """Device of the state and of every output tensor."""

    def __post_init__(self) -> None:
        top = self.capacity if self.max_agents is None else self.max_agents
        if not 1 <= self.min_agents <= top <= self.capacity:
            raise ValueError(f"need 1 <= min_agents ({self.min_agents}) <= max_agents ({top}) <= capacity "
                             f"({self.capacity})")
        if self.num_envs < 1 or self.max_steps < 1 or not 0.0 <= self.join_prob <= 1.0 or self.finish_radius <= 0:
            raise ValueError("num_envs, max_steps >= 1, join_prob in [0, 1] and finish_radius > 0 required")


def spread_tree(capacity: int) -> Tree:
    """The tree of :class:`Spread` with ``capacity`` slots (group ``"agents"``)."""
    obs = Leaf.box((6 + 3 * (capacity - 1),), low=-2.0, high=2.0)
    state = Leaf.box((capacity * 7,), low=-2.0, high=2.0, eval_only=True)
    return ArrayPopulation(template=AgentNode(observation=obs, action=Leaf.discrete(5)), capacity=capacity,
                           payoff="cooperative", shared_observation=state)


class Spread(BuiltinEnv):
    """``num_envs`` cooperative navigation envs with a variable number of agents (module doc).

    Public state ``[env, agent, ...]``: ``pos``, ``vel``, ``goal`` (float32, ``[..., 2]``), ``status`` (int8:
    0 waiting, 1 active, 2 gone) and ``steps`` ``[env]``.
    """

    def __init__(self, config: SpreadConfig | None = None) -> None:
        self.config = c = config if config is not None else SpreadConfig()
        self._tree = spread_tree(c.capacity)
        self._group = next(iter(groups(self._tree)))
        self._device = torch.device(c.device)
        n, k = c.num_envs, c.capacity
        self._env_batch, self._group_batch = torch.Size([n]), torch.Size([n, k])
        # every move is always legal: one constant tensor shared by every step (read-only, adapters.protocol)
        self._legal = all_true(*self._group_batch, 5, device=self._device)
        self._generator = torch.Generator(device=self._device)
        self._seeded = False
        self._directions = torch.tensor(_DIRECTIONS, device=self._device)
        # Row-major [k, k - 1] list of the slots j != i for every i: gathers every agent's others at once.
        self._others = torch.tensor([j for i in range(k) for j in range(k) if j != i], device=self._device)
        self.pos, self.vel, self.goal, self.status = self._draw(n)
        self.steps = torch.zeros(n, dtype=torch.int64, device=self._device)

    def reset(self, seed: int | None = None) -> TensorDict:
        """Starts a new episode in every env; ``seed`` seeds the batch's generator (None: continue)."""
        self._seed_(seed)
        self.pos, self.vel, self.goal, self.status = self._draw(self.num_envs)
        self.steps = torch.zeros_like(self.steps)
        return reset_output(self._group, self._root(), self._env_batch, self._group_batch, self._state())

    def step(self, actions: TensorDict) -> TensorDict:
        """Applies ``(agents, action)`` ``[env, capacity]`` (ignored for absent agents); see the module doc."""
        c, n = self.config, self.num_envs
        present = self.status == ACTIVE
        # Absent agents have zero velocity and a no-op action, so they stay put without a masked update.
        action = torch.where(present, actions.get((self._group, ACTION)), 0).clamp_(0, 4).flatten()
        accel = self._directions.index_select(0, action).view(n, c.capacity, 2)
        vel = torch.add(self.vel * (1 - DAMPING), accel, alpha=ACCEL * DT)
        pos = torch.add(self.pos, vel, alpha=DT).clamp_(-1.0, 1.0)
        dist = torch.linalg.vector_norm(self.goal - pos, dim=-1)
        arrived = present & (dist < c.finish_radius)
        reward = torch.where(present, arrived.float() * c.arrival_bonus - c.distance_coef * dist, 0.0)
        if c.shared_reward:
            team = reward.sum(1, keepdim=True) / present.sum(1, keepdim=True).clamp(min=1)
            reward = torch.where(present, team, 0.0)
        status = torch.where(arrived, GONE, self.status)
        nobody = ~(status == ACTIVE).any(1, keepdim=True)
        joins = (status == WAITING) & ((torch.rand(self._group_batch, generator=self._generator,
                                                   device=self._device) < c.join_prob) | nobody)
        status = torch.where(joins, ACTIVE, status).to(torch.int8)
        self.pos, self.vel, self.status, self.steps = pos, vel, status, self.steps + 1
        terminated = ~(status == ACTIVE).any(1)
        truncated = (self.steps >= c.max_steps) & ~terminated
        done = terminated | truncated
        final_obs, final_state = self._observe(present), self._state()
        self.vel = vel * (~arrived).unsqueeze(-1)  # leavers stop (after their final observation)
        agent_truncated = present & ~arrived & truncated.unsqueeze(1)
        nxt = {OBSERVATION: final_obs, REWARD: reward.unsqueeze(-1), TERMINATED: arrived.unsqueeze(-1),
               TRUNCATED: agent_truncated.unsqueeze(-1), DONE: (arrived | agent_truncated).unsqueeze(-1), MASK: present}
        ended = done.nonzero().squeeze(1)
        if ended.numel():
            fresh = self._draw(ended.numel())
            for name, value in zip(("pos", "vel", "goal", "status"), fresh):
                setattr(self, name, getattr(self, name).index_copy(0, ended, value))
            self.steps = self.steps.index_fill(0, ended, 0)
        flags = (terminated.unsqueeze(1), truncated.unsqueeze(1), done.unsqueeze(1))
        return assemble_step(self._group, self._root(), nxt, flags, self._env_batch, self._group_batch,
                             self._state(), final_state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that decides the future of the batch (checkpoints resume it exactly)."""
        return {"pos": self.pos.clone(), "vel": self.vel.clone(), "goal": self.goal.clone(),
                "status": self.status.clone(), "steps": self.steps.clone(), "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict` output."""
        for name in ("pos", "vel", "goal", "status", "steps"):
            setattr(self, name, state[name].to(getattr(self, name)).clone())
        self._generator.set_state(state["rng"])
        self._seeded = True

    def close(self) -> None:
        """Nothing to release."""

    def _draw(self, n: int) -> tuple[torch.Tensor, ...]:
        """Fresh episodes for ``n`` envs: ``(pos, vel, goal, status)``."""
        c, k, g, d = self.config, self.config.capacity, self._generator, self._device
        pos = torch.rand(n, k, 2, generator=g, device=d).mul_(2).sub_(1)
        goal = torch.rand(n, k, 2, generator=g, device=d).mul_(2).sub_(1)
        top = c.capacity if c.max_agents is None else c.max_agents
        count = torch.randint(c.min_agents, top + 1, (n, 1), generator=g, device=d)
        rank = torch.rand(n, k, generator=g, device=d).argsort(1).argsort(1)  # a random order of the slots
        status = torch.where(rank < count, ACTIVE, WAITING).to(torch.int8)
        return pos, torch.zeros_like(pos), goal, status

    def _observe(self, mask: torch.Tensor) -> torch.Tensor:
        """``[env, capacity, obs]`` observations of the current state, zero where ``mask`` is False."""
        n, k = self._group_batch
        # index_select, not advanced indexing: 10x cheaper here for the [env, k, k - 1] gather.
        visible = (self.status == ACTIVE).float().index_select(1, self._others).view(n, k, k - 1, 1)
        rel = (self.pos.index_select(1, self._others).view(n, k, k - 1, 2) - self.pos.unsqueeze(2)) * visible
        obs = torch.cat((self.pos, self.vel, self.goal - self.pos, rel.flatten(2), visible.flatten(2)), -1)
        return obs * mask.unsqueeze(-1)

    def _state(self) -> torch.Tensor:
        """``[env, capacity * 7]`` global state (shared observation)."""
        present = (self.status == ACTIVE).float().unsqueeze(-1)
        return torch.cat((self.pos, self.vel, self.goal, present), -1).flatten(1)

    def _root(self) -> dict:
        present = self.status == ACTIVE
        return {OBSERVATION: self._observe(present), MASK: present,
                ACTION_MASK: self._legal}


__all__ = ["Spread", "SpreadConfig", "spread_tree"]
