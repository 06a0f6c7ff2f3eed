"""A batched CartPole in torch with gymnasium CartPole-v1's dynamics, behind the batched-env protocol.

Same constants, Euler integration, termination (``|x| > 2.4`` or ``|theta| > 12°``), reward (1 per step,
including the terminating one), time limit (500 steps -> truncated, set even when the last step also
terminates, like gymnasium's ``TimeLimit``) and initial state (uniform in ``[-0.05, 0.05)``). One agent,
group ``"agent"`` (what :func:`core.specs.groups` names a bare :class:`AgentNode`), capacity 1.

Finished envs are reset inside :meth:`CartPole.step`; the final observation stays under ``"next"``.
Randomness comes from one ``torch.Generator`` for the whole batch: ``reset(seed)`` seeds the batch, not
env ``i`` with ``seed + i`` (a per-env stream would need a per-env loop).

Per-episode parameters (a prior distribution over envs, :mod:`orchestration.env_collection`): with a sampler
set (:meth:`CartPole.set_param_sampler`), every env draws its physical parameters (:data:`EPISODE_PARAMS`)
at each reset, so each episode runs with its own gravity, masses, pole length or force; without one the
constants below apply (and the fast constant-parameter path runs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, DONE, MASK, OBSERVATION, REWARD, TERMINATED, TRUNCATED, all_true
from core.specs import AgentNode, Leaf, Tree, groups
from core.tensordicts import get_leaf

from ._base import BuiltinEnv
from ._tensordicts import assemble_step, reset_output

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02
THETA_THRESHOLD = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4

#: Parameters a sampler may draw per episode, with their defaults (gymnasium's constants; ``length`` is half the
#: pole's length, as in gymnasium).
EPISODE_PARAMS: dict[str, float] = {"gravity": GRAVITY, "masscart": MASSCART, "masspole": MASSPOLE, "length": LENGTH,
                                    "force_mag": FORCE_MAG}

# gymnasium's observation bounds are float32: twice the thresholds, unbounded velocities.
_HIGH = tuple(torch.tensor([X_THRESHOLD * 2, math.inf, THETA_THRESHOLD * 2, math.inf]).tolist())
CARTPOLE_TREE: Tree = AgentNode(observation=Leaf.box((4,), low=tuple(-h for h in _HIGH), high=_HIGH),
                                action=Leaf.discrete(2))


@dataclass(frozen=True, kw_only=True, slots=True)
class CartPoleConfig:
    """Settings of :class:`CartPole`."""

    num_envs: int = 1024
    """Number of envs stepped together."""
    max_steps: int = 500
    """Episode length after which an episode is truncated (CartPole-v1: 500)."""
    dtype: torch.dtype = torch.float32
    """Dtype of the physical state; ``torch.float64`` follows gymnasium's float64 arithmetic (observations
    are float32 either way)."""
    device: str = "cpu"
    """Device of the state and of every output tensor."""

    def __post_init__(self) -> None:
        if self.num_envs < 1 or self.max_steps < 1:
            raise ValueError(f"num_envs ({self.num_envs}) and max_steps ({self.max_steps}) must be >= 1")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {self.dtype}")


def cartpole_dynamics(state: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Euler step of CartPole for a batch (gymnasium's equations, with fused multiply-adds).

    The state is stored component-major, ``[4, *batch]``: every op then runs on contiguous rows (on this CPU an
    ``[env, 4]`` layout makes ``torch.stack(..., dim=1)`` cost 370 µs at 16384 envs against 22 µs). The env
    keeps it ``[4, env, 1]``, so that actions come in and flags go out in its group's ``[env, 1]`` layout.

    Args:
        state: ``[4, *batch]`` rows x, x_dot, theta, theta_dot (``batch``: ``[env]`` or ``[env, 1]``).
        action: ``[*batch]`` integer; 1 pushes right, anything else left (gymnasium asserts {0, 1}).

    Returns:
        ``(next_state [4, *batch], terminated [*batch] bool)``; ``state`` is not modified.
    """
    _, thresholds, push_right, push_left = _constants(state.dtype, state.device, state.dim())
    x, x_dot, theta, theta_dot = state.unbind(0)
    force = torch.where(action == 1, push_right, push_left)
    cos, sin = theta.cos(), theta.sin()
    temp = torch.addcmul(force, theta_dot.square(), sin, value=POLEMASS_LENGTH).div_(TOTAL_MASS)
    theta_acc = torch.addcmul(sin.mul(GRAVITY), cos, temp, value=-1.0).div_(
        cos.square().mul_(-LENGTH * MASSPOLE / TOTAL_MASS).add_(LENGTH * 4.0 / 3.0))
    x_acc = torch.addcmul(temp, theta_acc, cos, value=-POLEMASS_LENGTH / TOTAL_MASS)
    nxt = torch.add(state, torch.stack((x_dot, x_acc, theta_dot, theta_acc)), alpha=TAU)
    terminated = (nxt[0::2].abs() > thresholds).any(0)
    return nxt, terminated


def cartpole_dynamics_per_env(state: torch.Tensor, action: torch.Tensor,
                              params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cartpole_dynamics` with each env's own physical parameters (gymnasium's equations).

    Args:
        state: ``[4, *batch]`` rows x, x_dot, theta, theta_dot.
        action: ``[*batch]`` integer; 1 pushes right, anything else left.
        params: every name of :data:`EPISODE_PARAMS` -> ``[*batch]`` tensor of the state's dtype.

    Returns:
        ``(next_state [4, *batch], terminated [*batch] bool)``; ``state`` is not modified.
    """
    _, thresholds, _, _ = _constants(state.dtype, state.device, state.dim())
    gravity, masspole, length = params["gravity"], params["masspole"], params["length"]
    total_mass = params["masscart"] + masspole
    polemass_length = masspole * length
    x, x_dot, theta, theta_dot = state.unbind(0)
    force = torch.where(action == 1, params["force_mag"], -params["force_mag"])
    cos, sin = theta.cos(), theta.sin()
    temp = (force + polemass_length * theta_dot.square() * sin) / total_mass
    theta_acc = (gravity * sin - cos * temp) / (length * (4.0 / 3.0 - masspole * cos.square() / total_mass))
    x_acc = temp - polemass_length * theta_acc * cos / total_mass
    nxt = torch.add(state, torch.stack((x_dot, x_acc, theta_dot, theta_acc)), alpha=TAU)
    terminated = (nxt[0::2].abs() > thresholds).any(0)
    return nxt, terminated


def initial_states(n: int, generator: torch.Generator, dtype: torch.dtype, device,
                   trailing: tuple[int, ...] = ()) -> torch.Tensor:
    """``[4, n, *trailing]`` states uniform in ``[-0.05, 0.05)`` (gymnasium's ``uniform(low, high)`` = low + u *
    width); ``trailing`` dims of size 1 leave the values as they are."""
    return torch.rand(4, n, *trailing, generator=generator, dtype=dtype, device=device).mul_(0.1).sub_(0.05)


def observations(state: torch.Tensor) -> torch.Tensor:
    """``[env, 1, 4]`` float32 observations of a ``[4, env]`` (or ``[4, env, 1]``) state: a view of ``state`` when it
    is float32 (the env never writes into a state once made: every step makes a new one), else a converted copy.

    A view, not a transposed copy: a consumer that copies the observation (fragment storage) or multiplies it
    (a policy's first layer reads a transposed operand as it is) pays the transpose once, where the env used
    to pay it twice per step (final and next observation; ``benchmarks/builtin_throughput.py``).
    """
    rows = state if state.dtype == torch.float32 else state.to(torch.float32)
    if rows.is_contiguous():  # one view op instead of two (t, unsqueeze): each op counts in a small batch's step
        return rows.as_strided((rows.shape[1], 1, 4), (1, rows.shape[1], rows.shape[1]))
    return rows.reshape(4, -1).t().unsqueeze(1)


@functools.lru_cache(maxsize=8)
def _constants(dtype: torch.dtype, device: torch.device, dims: int = 2) -> tuple[torch.Tensor, ...]:
    """Per-dtype constants, made once: identity, ``[[x], [theta]]`` thresholds (``[2, 1, ...]``, ``dims`` dims, to
    compare with ``state[0::2]``), the two forces."""
    return (torch.eye(4, dtype=dtype, device=device),
            torch.tensor([X_THRESHOLD, THETA_THRESHOLD], dtype=dtype, device=device).view(2, *(1,) * (dims - 1)),
            torch.tensor(FORCE_MAG, dtype=dtype, device=device), torch.tensor(-FORCE_MAG, dtype=dtype, device=device))


class CartPole(BuiltinEnv):
    """``num_envs`` CartPoles stepped together (a :class:`adapters.protocol.BatchedEnv`).

    Public state, for tests and tools: ``state`` ``[env, 4]`` (``config.dtype``; a copy of the ``[4, env, 1]``
    storage; assign a new tensor to change it), ``steps`` ``[env]`` int64 (steps taken in the episode) and
    ``params`` (each env's per-episode parameters, ``{}`` without a sampler).
    """

    episode_params: tuple[str, ...] = tuple(EPISODE_PARAMS)
    """Names a per-episode parameter sampler may draw (:meth:`set_param_sampler`)."""

    def __init__(self, config: CartPoleConfig | None = None) -> None:
        self.config = config if config is not None else CartPoleConfig()
        n, self._device = self.config.num_envs, torch.device(self.config.device)
        self._group = next(iter(groups(CARTPOLE_TREE)))
        self._env_batch, self._group_batch = torch.Size([n]), torch.Size([n, 1])
        self._generator = torch.Generator(device=self._device)
        self._seeded = False
        self._state = torch.zeros(4, n, 1, dtype=self.config.dtype, device=self._device)  # [4, env, agent]
        self._steps = torch.zeros(n, 1, dtype=torch.int64, device=self._device)  # [env, 1]: as the env-level flags
        # Constant entries, one tensor shared by every step (step tensors are read-only to consumers, see
        # adapters.protocol): a reward of 1, every env present, both actions legal.
        self._reward = torch.ones(n, 1, 1, device=self._device)  # float32 whatever the dynamics dtype
        self._present = all_true(n, 1, device=self._device)
        self._legal = all_true(n, 1, 2, device=self._device)
        self._sampler: Callable[[int], Mapping[str, torch.Tensor]] | None = None
        self._params: dict[str, torch.Tensor] | None = None  # name -> [env]; None: the module's constants
        self._max_steps = self.config.max_steps
        # observations are [env, 1, 4] views of a contiguous float32 [4, env, 1] state (observations())
        self._obs_view = ((n, 1, 4), (1, n, n)) if self.config.dtype == torch.float32 else None

    @property
    def tree(self) -> Tree:
        return CARTPOLE_TREE

    @property
    def state(self) -> torch.Tensor:
        """``[env, 4]`` physical state (x, x_dot, theta, theta_dot)."""
        return self._state.view(4, -1).t().clone()  # a copy: observations handed out view the state

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self._state = value.to(self._state).t().unsqueeze(2).clone(memory_format=torch.contiguous_format)

    @property
    def steps(self) -> torch.Tensor:
        """``[env]`` int64 steps taken in each env's current episode (a view; assign a new tensor to change it)."""
        return self._steps.view(-1)

    @steps.setter
    def steps(self, value: torch.Tensor) -> None:
        self._steps = value.to(self._steps).reshape(self._steps.shape).clone()

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Each env's parameters of its current episode (``[env]`` per name); ``{}`` without a sampler."""
        return {} if self._params is None else {k: v.clone() for k, v in self._params.items()}

    def set_param_sampler(self, sampler: Callable[[int], Mapping[str, torch.Tensor]] | None) -> None:
        """Draws each episode's parameters with ``sampler(k)`` -> ``{name: [k]}`` at every reset of ``k`` envs
        (names from :attr:`episode_params`; one left out keeps its default). None: the constants again.
        Takes effect at the next reset of each env."""
        self._sampler = sampler
        if sampler is None:
            self._params = None

    def _draw_params(self, rows: torch.Tensor | None) -> None:
        """New parameters for ``rows`` (``[k]`` indices; None: every env) from the sampler."""
        k = self.num_envs if rows is None else rows.numel()
        drawn = self._sampler(k)
        unknown = sorted(set(drawn) - set(EPISODE_PARAMS))
        if unknown:
            raise ValueError(f"builtin:cartpole cannot take the per-episode parameters {unknown}; it takes "
                             f"{', '.join(EPISODE_PARAMS)}")
        if self._params is None:
            self._params = {name: torch.full((self.num_envs,), value, dtype=self.config.dtype, device=self._device)
                            for name, value in EPISODE_PARAMS.items()}
        for name, values in drawn.items():
            values = torch.as_tensor(values).to(dtype=self.config.dtype, device=self._device).reshape(k)
            if rows is None:
                self._params[name] = values.clone()
            else:
                self._params[name].index_copy_(0, rows, values)

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets every env; ``seed`` seeds the batch's generator (None: continue its stream)."""
        self._seed_(seed)
        self._state = initial_states(self.num_envs, self._generator, self.config.dtype, self._device, (1,))
        self._steps = torch.zeros_like(self._steps)
        if self._sampler is not None:
            self._draw_params(None)
        return reset_output(self._group, self._root(), self._env_batch, self._group_batch)

    def step(self, actions: TensorDict) -> TensorDict:
        """Applies ``(agent, action)`` ``[env, 1]`` and resets the envs whose episode ended (module doc)."""
        n = self.num_envs
        action = get_leaf(actions, self._group, ACTION).reshape(n, 1)  # the state's batch (a wrong size raises)
        if self._params is None:
            nxt, terminated = cartpole_dynamics(self._state, action)
        else:
            nxt, terminated = cartpole_dynamics_per_env(self._state, action,
                                                        {k: v.view(n, 1) for k, v in self._params.items()})
        self._steps = steps = self._steps + 1  # a new tensor: one read from .steps earlier stays as it was
        truncated = steps >= self._max_steps
        done = terminated | truncated  # [env, 1], as the env-level flags are
        final_obs = self._observations(nxt)  # a view: nxt is never written to, the reset goes into a copy
        ended = done.nonzero().select(1, 0)
        if ended.numel():  # partial reset by index: fresh states for the finished envs only
            fresh = initial_states(ended.numel(), self._generator, self.config.dtype, self._device, (1,))
            nxt = nxt.index_copy(1, ended, fresh)
            steps.index_fill_(0, ended, 0)
            if self._sampler is not None:
                self._draw_params(ended)
            obs = self._observations(nxt)
        else:
            obs = final_obs
        self._state = nxt
        flags = (terminated, truncated, done)
        nxt_group = {OBSERVATION: final_obs, REWARD: self._reward, TERMINATED: terminated.view(n, 1, 1),
                     TRUNCATED: truncated.view(n, 1, 1), DONE: done.view(n, 1, 1), MASK: self._present}
        return assemble_step(self._group, self._root(obs), nxt_group, flags, self._env_batch, self._group_batch)

    def _observations(self, state: torch.Tensor) -> torch.Tensor:
        """:func:`observations` of a state this env made (contiguous ``[4, env, 1]``), one view op when float32."""
        return state.as_strided(*self._obs_view) if self._obs_view is not None else observations(state.view(4, -1))

    def _root(self, obs: torch.Tensor | None = None) -> dict:
        obs = self._observations(self._state) if obs is None else obs
        return {OBSERVATION: obs, MASK: self._present, ACTION_MASK: self._legal}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that decides the future of the batch (checkpoints resume it exactly)."""
        out = {"state": self._state.view(4, -1).clone(), "steps": self.steps.clone(),  # [4, env], [env]
               "rng": self._generator.get_state()}
        out.update({f"param/{k}": v.clone() for k, v in (self._params or {}).items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict` output."""
        self._state = state["state"].to(self._state).reshape(4, -1, 1).clone(memory_format=torch.contiguous_format)
        self.steps = state["steps"]
        self._generator.set_state(state["rng"])
        self._seeded = True
        params = {k.removeprefix("param/"): v for k, v in state.items() if k.startswith("param/")}
        self._params = {k: v.to(self._state).clone() for k, v in params.items()} if params else None

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["CARTPOLE_TREE", "EPISODE_PARAMS", "CartPole", "CartPoleConfig", "cartpole_dynamics",
           "cartpole_dynamics_per_env", "initial_states", "observations"]
