"""A torchrl ``EnvBase`` whose batch already lives in torch (VMAS, a ``SerialEnv``...) behind the protocol.

No per-env Python loop: one ``env.step_and_maybe_reset`` per step, which resets the finished envs through
torchrl's ``"_reset"`` masks (partial reset) and keeps the final observation under ``"next"``.

Spec mapping (``env.batch_size`` must be ``[env]``):

- a top-level observation/action entry that is a ``Composite`` of shape ``[env, n]`` is a *group* of ``n``
  agents and keeps its name; the group becomes an :class:`ArrayPopulation` member of a
  :class:`DictPopulation`. Its ``"observation"`` entry alone becomes the leaf ``(group, "observation")``;
  several entries become a dict node. ``"mask"`` and ``"action_mask"`` map to ours; entries named in
  ``config.ignore_keys`` (VMAS's ``"info"``) are dropped;
- other top-level observation entries of a multi-agent env are shared observations tagged ``eval_only``;
- an env without groups is one agent (group ``"agent"``, capacity 1) observing every root entry;
- leaves go through :func:`core.specs.leaf_from_torchrl`; ``OneHot`` actions become ``Leaf.discrete`` (the
  adapter one-hot encodes them), ``OneHot`` observations ``Leaf.binary``;
- rewards: ``(group, "reward")`` per agent, else the root reward for every agent of the group;
- flags: group-level ``terminated``/``truncated`` when the env has them, else the root ones broadcast; root
  flags: the env's root ones, else any agent's. ``done`` is recomputed as ``terminated | truncated``; an env
  without ``truncated`` (VMAS: its ``max_steps`` sets ``terminated``) reports ``truncated`` False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torchrl.data import Composite, OneHot, TensorSpec
from torchrl.envs import EnvBase

from adapters.builtin._tensordicts import fast_td
from core.layout import (ACTION, ACTION_MASK, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED,
                         TRUNCATED)
from core.specs import AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, Node, Payoff, Tree, leaf_from_torchrl

_FLAGS = (TERMINATED, TRUNCATED)


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchRLEnvConfig:
    """Settings of :class:`TorchRLEnv`."""

    payoff: Payoff = "general"
    """Payoff recorded in the tree (torchrl specs carry none)."""
    ignore_keys: tuple[str, ...] = ("info",)
    """Observation entries with these names, at any depth, are not observations."""

    def __post_init__(self) -> None:
        if self.payoff not in ("cooperative", "zero_sum", "general"):
            raise ValueError(f"unknown payoff {self.payoff!r}")


def _leaf(spec: TensorSpec, ndim: int, eval_only: bool, action: bool) -> tuple[Leaf, int]:
    """(leaf, one-hot size or 0) of a spec with ``ndim`` batch dims."""
    spec = spec[(0,) * ndim] if ndim else spec
    if isinstance(spec, OneHot) and action:
        return Leaf.discrete(spec.space.n), spec.space.n
    if isinstance(spec, OneHot):
        return Leaf.binary(spec.space.n, dtype=spec.dtype, eval_only=eval_only), 0
    return leaf_from_torchrl(spec, eval_only=eval_only), 0


def _node(spec: Composite, names: list[str], ndim: int, single: str | None, trl_prefix: tuple, our_prefix: tuple,
          pairs: list, *, eval_only: bool = False, action: bool = False) -> Node:
    """The node of ``spec``'s entries ``names``; appends ``(our_key, torchrl_key, one_hot_n, dtype)`` to ``pairs``.

    A lone entry called ``single`` becomes a bare leaf at ``our_prefix``.
    """
    if names == [single] and isinstance(spec[single], Composite):  # no extra level for a lone dict entry
        child = spec[single]
        return _node(child, list(child.keys()), ndim, None, (*trl_prefix, single), our_prefix, pairs,
                     eval_only=eval_only, action=action)
    if names == [single]:
        leaf, one_hot = _leaf(spec[single], ndim, eval_only, action)
        pairs.append((our_prefix, (*trl_prefix, single), one_hot, spec[single].dtype))
        return leaf
    children = {}
    for name in names:
        child = spec[name]
        if isinstance(child, Composite):
            children[name] = _node(child, list(child.keys()), ndim, None, (*trl_prefix, name), (*our_prefix, name),
                                   pairs, eval_only=eval_only, action=action)
        else:
            children[name], one_hot = _leaf(child, ndim, eval_only, action)
            pairs.append(((*our_prefix, name), (*trl_prefix, name), one_hot, child.dtype))
    return DictNode(children)


class TorchRLEnv:
    """A torchrl ``EnvBase`` with batch ``[env]`` as a :class:`adapters.protocol.BatchedEnv` (module doc)."""

    def __init__(self, env: EnvBase, config: TorchRLEnvConfig | None = None) -> None:
        if len(env.batch_size) != 1:
            raise ValueError(f"need an env with batch_size [env], got {tuple(env.batch_size)}; wrap unbatched "
                             "envs in torchrl's SerialEnv/ParallelEnv")
        self.config = c = config if config is not None else TorchRLEnvConfig()
        self._env, self._closed, self._td = env, False, None
        n = env.batch_size[0]
        obs, act = env.full_observation_spec, env.full_action_spec
        multi = {k: s.shape[1] for spec in (obs, act) for k, s in spec.items()
                 if isinstance(s, Composite) and len(s.shape) == 2}
        self._obs_pairs, self._act_pairs, self._shared_pairs = [], [], []
        self._sizes: dict[str, int] = {}
        self._single = not multi
        if self._single:
            names = [k for k in obs.keys() if k not in c.ignore_keys]
            node = _node(obs, names, 1, "observation", (), ("agent", OBSERVATION), self._obs_pairs)
            action = _node(act, list(act.keys()), 1, "action", (), ("agent", ACTION), self._act_pairs, action=True)
            self._tree: Tree = AgentNode(observation=node, action=action)
            self._sizes["agent"] = 1
        else:
            members = {}
            for g, size in multi.items():
                ignored = {*c.ignore_keys, MASK, ACTION_MASK}
                if g not in obs.keys():
                    raise ValueError(f"group {g!r} has actions but no observation entry")
                names = [k for k in obs[g].keys() if k not in ignored]
                node = _node(obs[g], names, 2, "observation", (g,), (g, OBSERVATION), self._obs_pairs)
                action = _node(act[g], list(act[g].keys()), 2, "action", (g,), (g, ACTION), self._act_pairs,
                               action=True)
                members[g] = ArrayPopulation(template=AgentNode(observation=node, action=action),
                                             capacity=size, payoff=c.payoff)
                self._sizes[g] = size
            names = [k for k in obs.keys() if k not in multi and k not in c.ignore_keys]
            shared = _node(obs, names, 1, names[0] if len(names) == 1 else None, (), (SHARED,), self._shared_pairs,
                           eval_only=True) if names else None
            self._tree = DictPopulation(members=members, payoff=c.payoff, shared_observation=shared)
        self._env_batch = torch.Size([n])
        self._done_keys = set(env.done_keys)
        self._reward_keys = set(env.reward_keys)
        self._obs_keys = set(obs.keys(True))
        self._mask: dict[str, torch.Tensor] = {}

    @property
    def tree(self) -> Tree:
        return self._tree

    @property
    def num_envs(self) -> int:
        return self._env_batch[0]

    @property
    def counters(self) -> dict[str, int]:
        return {}

    @property
    def env(self) -> EnvBase:
        """The wrapped torchrl env."""
        return self._env

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets every env; ``seed`` goes to ``env.set_seed`` (torchrl seeds the batch as a whole)."""
        if seed is not None:
            self._env.set_seed(seed)
        self._td = self._env.reset()
        return self._root(self._td)

    def step(self, actions: TensorDict) -> TensorDict:
        """Applies ``actions`` (batch ``[env]``) through ``env.step_and_maybe_reset``; see the module doc."""
        td = self._td
        for ours, theirs, one_hot, dtype in self._act_pairs:
            value = actions.get(ours)
            if self._single:
                value = value.squeeze(1)
            td.set(theirs, F.one_hot(value, one_hot).to(dtype) if one_hot else value)
        mask = dict(self._mask)  # agents present at this step
        out, self._td = self._env.step_and_maybe_reset(td)
        nxt = out.get(NEXT)
        root = self._root(self._td)
        nxt_src = self._observations(nxt)
        root_flags = {}
        for g, size in self._sizes.items():
            group = nxt_src[g]
            group[REWARD] = self._per_agent(nxt, g, REWARD, size).to(torch.float32)
            for flag in _FLAGS:
                group[flag] = self._per_agent(nxt, g, flag, size)
            group[DONE] = group[TERMINATED] | group[TRUNCATED]
            group[MASK] = mask[g]
            nxt_src[g] = fast_td(group, torch.Size([self.num_envs, size]))
        for flag in _FLAGS:
            root_flags[flag] = self._root_flag(nxt, flag, nxt_src)
        root_flags[DONE] = root_flags[TERMINATED] | root_flags[TRUNCATED]
        nxt_src.update(root_flags)
        src = dict(root.items())
        src[NEXT] = fast_td(nxt_src, self._env_batch)
        return fast_td(src, self._env_batch)

    def close(self) -> None:
        """Closes the torchrl env; idempotent."""
        if not self._closed:
            self._closed = True
            if not getattr(self._env, "is_closed", False):  # a batched env never started is closed: it would raise
                self._env.close()

    # -- reading torchrl data ------------------------------------------------------------------------------
    def _observations(self, td: TensorDict) -> dict:
        """``{group: {observation...}, "shared": ...}``, groups as plain dicts, observation subtrees as TDs."""
        out: dict = {g: {} for g in self._sizes}
        for ours, theirs, *_ in self._obs_pairs:
            value = td.get(theirs)
            _put(out, ours, value.unsqueeze(1) if self._single else value)
        for ours, theirs, *_ in self._shared_pairs:
            _put(out, ours, td.get(theirs))
        for g, node in out.items():
            if g in self._sizes and isinstance(node.get(OBSERVATION), dict):
                node[OBSERVATION] = _as_td(node[OBSERVATION], torch.Size([self.num_envs, self._sizes[g]]))
        if isinstance(out.get(SHARED), dict):
            out[SHARED] = _as_td(out[SHARED], self._env_batch)
        return out

    def _root(self, td: TensorDict) -> TensorDict:
        src = self._observations(td)
        device = self._env.device
        for g, size in self._sizes.items():
            gb = torch.Size([self.num_envs, size])
            mask = td.get((g, MASK)) if (g, MASK) in self._obs_keys else torch.ones(gb, dtype=torch.bool, device=device)
            self._mask[g] = mask
            src[g][MASK] = mask
            if (g, ACTION_MASK) in self._obs_keys:
                src[g][ACTION_MASK] = td.get((g, ACTION_MASK))
            elif self._discrete_n(g):
                src[g][ACTION_MASK] = torch.ones(*gb, self._discrete_n(g), dtype=torch.bool, device=device)
            src[g] = fast_td(src[g], gb)
        return fast_td(src, self._env_batch)

    def _discrete_n(self, g: str) -> int:
        node = (self._tree.action if self._single else self._tree.members[g].template.action)
        return node.n if isinstance(node, Leaf) and node.kind == "discrete" else 0

    def _per_agent(self, nxt: TensorDict, g: str, name: str, size: int) -> torch.Tensor:
        """``[env, size, 1]`` reward or flag of group ``g`` (its own, else the root's broadcast)."""
        keys = self._reward_keys if name == REWARD else self._done_keys
        if not self._single and (g, name) in keys:
            return nxt.get((g, name))
        if name in keys:
            return nxt.get(name).unsqueeze(1).expand(self.num_envs, size, 1).clone()
        if name == TERMINATED and DONE in keys:  # a done-only env: done means terminated
            return self._per_agent(nxt, g, DONE, size)
        dtype = torch.float32 if name == REWARD else torch.bool
        return torch.zeros(self.num_envs, size, 1, dtype=dtype, device=self._env.device)

    def _root_flag(self, nxt: TensorDict, name: str, groups_src: dict) -> torch.Tensor:
        if name in self._done_keys:
            return nxt.get(name).clone()
        if name == TERMINATED and DONE in self._done_keys:
            return nxt.get(DONE).clone()
        flags = [groups_src[g].get(name).any(1) for g in self._sizes]
        return torch.stack(flags).any(0)


def _put(tree: dict, key: tuple, value) -> None:
    for k in key[:-1]:
        tree = tree.setdefault(k, {})
    tree[key[-1]] = value


def _as_td(tree: dict, batch: torch.Size) -> TensorDict:
    return fast_td({k: _as_td(v, batch) if isinstance(v, dict) else v for k, v in tree.items()}, batch)


__all__ = ["TorchRLEnv", "TorchRLEnvConfig"]
