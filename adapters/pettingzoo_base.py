"""Machinery shared by the PettingZoo adapters (:mod:`adapters.pettingzoo_env`): tree, slots, buffers, checks.

Per step, every group gets fresh numpy buffers ``[E, A, *leaf]`` filled with padding; per-agent dict values are
written into them in a Python loop over copies and agents (PettingZoo envs are per-instance Python anyway),
then checks, repairs and the conversion to tensors run vectorised over the whole batch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase

from core.layout import ACTION_MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import AgentNode, DictPopulation, Leaf, Payoff

from .action_masks import MASK_KEY, check_source, split_mask, unmaskable
from .assembly import AdapterBase, GroupNext, GroupStep, StepLayout, action_mask_size
from .checking import ActionCheck, Checker, CheckMode, EnvOutputError, LeafCheck, is_flag
from .spaces import SpaceCodec, space_to_node

_RESET_TRIES = 3
_SCALAR_TYPES = (float, int, np.float64, np.float32, np.int64, np.int32)


def _probe_state(env) -> spaces.Space | None:
    try:
        space = env.state_space
    except (AttributeError, NotImplementedError):
        return None
    try:
        env.reset(seed=0)
        env.state()
    except NotImplementedError:
        return None
    return space


class _AgentSlot:
    """Where one agent lives in the layout and how its samples convert."""

    __slots__ = ("name", "group", "slot", "obs", "act", "mask_in_obs", "plain_obs", "plain_act", "int_act")

    def __init__(self, name: str, group: int, slot: int, obs: SpaceCodec, act: SpaceCodec, mask_in_obs: bool):
        self.name, self.group, self.slot = name, group, slot
        self.obs, self.act, self.mask_in_obs = obs, act, mask_in_obs
        #: ``(shape, dtype)`` when a raw observation array is written as is (fast path), else None.
        self.plain_obs = obs.plain if not mask_in_obs else None
        #: True when the action is one plain leaf (``arrays[group][0][env, slot]`` is the env's action).
        self.plain_act = act.plain is not None
        #: True for a ``Discrete`` action: sent as a Python int (PettingZoo's bounds check, ``Discrete.contains``,
        #: takes an int without numpy's dtype tests; one ``tolist()`` per group converts them all)
        self.int_act = self.plain_act and isinstance(act.space, spaces.Discrete)


class _PettingZooBase(AdapterBase):
    """Tree, slots, buffers, checks, resets and assembly shared by the Parallel and AEC adapters."""

    def __init__(self, env_fn: Callable, num_envs: int, *, check: CheckMode, payoff: Payoff, action_mask: str,
                 state: bool | None) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        check_source(action_mask)
        self.envs = [env_fn() for _ in range(num_envs)]
        env0, self._num_envs = self.envs[0], num_envs
        self._possible = list(env0.possible_agents)
        members, parts = {}, {}
        for agent in env0.possible_agents:
            obs_space, in_obs = split_mask(env0.observation_space(agent), action_mask)
            act_space = env0.action_space(agent)
            members[agent] = AgentNode(observation=space_to_node(obs_space, f"{agent}/{OBSERVATION}"),
                                       action=space_to_node(act_space, f"{agent}/action"))
            parts[agent] = (obs_space, act_space, in_obs)
        state_space = _probe_state(env0) if state is not False else None
        shared = space_to_node(state_space, SHARED, eval_only=True) if state_space is not None else None
        self._tree = DictPopulation(members=members, payoff=payoff, shared_observation=shared)
        self._layout = StepLayout(self._tree, num_envs)
        self._specs = list(self._layout.groups.values())
        self._slots: dict[str, _AgentSlot] = {}
        for gi, spec in enumerate(self._specs):
            for s, agent in enumerate(spec.agent_names):
                obs_space, act_space, in_obs = parts[agent]
                self._slots[agent] = _AgentSlot(agent, gi, s, SpaceCodec(obs_space), SpaceCodec(act_space), in_obs)
        self._group_codec = [self._slots[spec.agent_names[0]].obs for spec in self._specs]
        self._int_groups = [self._slots[spec.agent_names[0]].int_act for spec in self._specs]
        self._checks = [[LeafCheck(c.leaf) for c in codec.leaves] for codec in self._group_codec]
        self._mask_n = [action_mask_size(spec) for spec in self._specs]
        for agent, (_, act_space, in_obs) in parts.items():
            if in_obs and self._mask_n[self._slots[agent].group] is None:
                raise ValueError(unmaskable(f"agent {agent!r}", act_space, "observation"))
        self._action_checks = [ActionCheck(spec, num_envs) for spec in self._specs]
        self._batch_shapes = [(num_envs, spec.capacity) for spec in self._specs]
        self._no_masks = [None] * len(self._specs)  # "every agent present", per group
        # (group, leaf, check, key after a step, key at a reset, agent names) of every observation leaf
        self._obs_checks = [
            (gi, li, check, (NEXT, spec.name, OBSERVATION, *c.key), (spec.name, OBSERVATION, *c.key), spec.agent_names)
            for gi, (spec, codec, checks) in enumerate(zip(self._specs, self._group_codec, self._checks))
            for li, (c, check) in enumerate(zip(codec.leaves, checks))]
        self._reward_keys = [((NEXT, spec.name, REWARD), spec.agent_names) for spec in self._specs]
        self._info_mask = action_mask in ("auto", "info")
        self._state = SpaceCodec(state_space, SHARED) if state_space is not None else None
        self._state_checks = [LeafCheck(c.leaf) for c in self._state.leaves] if self._state else []
        self._reward_check = LeafCheck(Leaf.box(()), finite_only=True)
        self._checker = Checker(check)
        self._counters = self._checker.counters
        self._closed = False
        self._root: dict | None = None

    def close(self) -> None:
        """Closes every copy; idempotent."""
        if not self._closed:
            self._closed = True
            for env in self.envs:
                env.close()

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets every copy (copy ``i`` seeded ``seed + i``); batch ``[env]``."""
        root = self._new_root()
        for e in range(self._num_envs):
            self._reset_one(e, None if seed is None else seed + e, root)
        self._root = self._checked_root(root)
        return self._layout.build(self._group_steps(self._root), self._root["shared"])

    # -- hooks ----------------------------------------------------------------------------------------------
    def _reset_one(self, e: int, seed: int | None, root: dict) -> None:
        """Resets copy ``e`` and writes its first step into row ``e`` of ``root``."""
        raise NotImplementedError

    # -- buffers --------------------------------------------------------------------------------------------
    def _new_obs(self) -> list[list[np.ndarray]]:
        """Fresh observation buffers ``[E, A, *leaf]`` per group and leaf, filled with the padding."""
        return [codec.buffers(batch) for codec, batch in zip(self._group_codec, self._batch_shapes)]

    def _new_root(self, obs: bool = True, mask: bool = True) -> dict:
        """Fresh root buffers.

        ``mask`` None (with ``mask=False``) says every agent of every copy is present; ``amask[g]`` stays None
        (all legal) until an env gives group ``g`` a mask.
        """
        return {"obs": self._new_obs() if obs else None,
                "mask": [np.zeros(s, dtype=bool) for s in self._batch_shapes] if mask else None,
                "amask": [None] * len(self._specs),
                "shared": self._state.buffers((self._num_envs,)) if self._state else None}

    def _new_next(self) -> dict:
        """Fresh buffers of a step's consequences; the flags stay None until an agent ends (see :meth:`_flags`)."""
        return {"obs": self._new_obs(), "reward": [np.zeros(s, dtype=np.float32) for s in self._batch_shapes],
                "terminated": None, "truncated": None,
                "shared": self._state.buffers((self._num_envs,)) if self._state else None}

    def _flags(self, nxt: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The per-agent ``(terminated, truncated)`` buffers of ``nxt``, allocated on first use."""
        if nxt["terminated"] is None:
            nxt["terminated"] = [np.zeros(s, dtype=bool) for s in self._batch_shapes]
            nxt["truncated"] = [np.zeros(s, dtype=bool) for s in self._batch_shapes]
        return nxt["terminated"], nxt["truncated"]

    def _write_flags(self, e: int, nxt: dict, terms: dict, truncs: dict) -> None:
        """Sets the per-agent flags of copy ``e`` from PettingZoo's ``terminations`` / ``truncations`` dicts."""
        for flags, buf, name in zip((terms, truncs), self._flags(nxt), (TERMINATED, TRUNCATED)):
            key = (NEXT, name)
            for agent, value in flags.items():  # a value that is no flag is reported and sets nothing
                if not self._not_a_flag(e, agent, name, value) and value and (slot := self._slot(e, agent, key)):
                    buf[slot.group][e, slot.slot] = True

    def _not_a_flag(self, e: int, agent, name: str, value) -> bool:
        """Reports a flag that is no bool (the string "False" would read as True); True when it is none."""
        if is_flag(value):
            return False
        if (slot := self._slot(e, agent, (NEXT, name))) is not None:
            key = (NEXT, self._specs[slot.group].name, name)
            self._checker.report(EnvOutputError(f"{name} is {value!r} ({type(value).__name__}), not a bool",
                                                env_index=e, agent=agent, key=key))
        return True

    def _clear_row(self, root: dict, e: int) -> None:
        if root["mask"] is None:  # every agent was present: the row about to change needs real masks
            root["mask"] = [np.ones(s, dtype=bool) for s in self._batch_shapes]
        for gi, codec in enumerate(self._group_codec):
            for buf, pad in zip(root["obs"][gi], codec.pads):
                buf[e] = pad
            root["mask"][gi][e] = False
            if root["amask"][gi] is not None:
                root["amask"][gi][e] = True

    # -- writing one agent ----------------------------------------------------------------------------------
    def _slot(self, e: int, agent, key: tuple[str, ...]) -> _AgentSlot | None:
        slot = self._slots.get(agent)
        if slot is None:
            self._checker.report(EnvOutputError(f"unknown agent (possible agents: {list(self._slots)})",
                                                env_index=e, agent=str(agent), key=key))
        return slot

    def _write_obs(self, e: int, slot: _AgentSlot, value, bufs: list[list[np.ndarray]], root: dict | None, info,
                   prefix: str | None) -> None:
        """Writes ``value`` into row ``(e, slot)`` of ``bufs``, and its action mask into ``root`` unless None."""
        gi = slot.group
        if slot.mask_in_obs:
            try:
                mask = value[MASK_KEY]
                value = value[OBSERVATION] if len(value) == 2 and OBSERVATION in value else \
                    {k: v for k, v in value.items() if k != MASK_KEY}
            except (KeyError, TypeError, IndexError):
                mask, value = None, {}
        else:
            mask = info.get(MASK_KEY) if self._info_mask and info else None
        problem = slot.obs.write(value, bufs[gi], (e, slot.slot))
        if problem is not None:
            group = self._specs[gi].name
            key = (NEXT, group, OBSERVATION) if prefix == NEXT else (group, OBSERVATION)
            self._checker.report(EnvOutputError(problem[1], env_index=e, agent=slot.name, key=(*key, *problem[0])))
        if mask is not None and root is not None and self._mask_n[gi] is None:  # an info mask Shoal cannot apply
            self._checker.report(EnvOutputError(unmaskable(f"agent {slot.name!r}", None, "info"), env_index=e,
                                                agent=slot.name, key=(self._specs[gi].name, ACTION_MASK)))
        elif mask is not None and root is not None and (n := self._mask_n[gi]) is not None:
            mask = np.asarray(mask)
            if mask.shape != (n,):
                self._checker.report(EnvOutputError(f"expected action mask shape ({n},), got {mask.shape}",
                                                    env_index=e, agent=slot.name,
                                                    key=(self._specs[gi].name, ACTION_MASK)))
            else:
                if root["amask"][gi] is None:
                    root["amask"][gi] = np.ones((self._num_envs, self._specs[gi].capacity, n), dtype=bool)
                root["amask"][gi][e, slot.slot] = mask

    def _write_state(self, e: int, env, bufs: list[np.ndarray], key: tuple[str, ...]) -> None:
        problem = self._state.write(env.state(), bufs, e)
        if problem is not None:
            self._checker.report(EnvOutputError(problem[1], env_index=e, agent=None, key=(*key, *problem[0])))

    def _write_reward(self, e: int, agent, value, nxt: dict) -> None:
        slot = self._slot(e, agent, (NEXT, REWARD))
        if slot is None:
            return
        if type(value) not in _SCALAR_TYPES and (np.ndim(value) != 0 or np.asarray(value).dtype.kind not in "biuf"):
            self._checker.report(EnvOutputError(f"expected a real number, got {value!r}", env_index=e,
                                                agent=slot.name, key=(NEXT, self._specs[slot.group].name, REWARD)))
            return
        nxt["reward"][slot.group][e, slot.slot] += value  # float32: a float64 beyond its range becomes Inf

    # -- checks and assembly --------------------------------------------------------------------------------
    def _check_obs(self, obs: list[list[np.ndarray]], shared, prefix: tuple[str, ...]) -> None:
        after_step = prefix == (NEXT,)
        for gi, li, check, next_key, root_key, names in self._obs_checks:
            arr = obs[gi][li]
            if check.bad(arr, 2) is not None:  # locate and report (values() checks again: the rare path)
                self._checker.values(check, arr, 2, next_key if after_step else root_key, names)
        if shared is not None:
            for c, check, arr in zip(self._state.leaves, self._state_checks, shared):
                self._checker.values(check, arr[:, None], 2, (*prefix, SHARED, *c.key), (None,))

    def _check_legal(self, root: dict) -> None:
        masks = root["mask"] or self._no_masks
        for spec, mask, amask in zip(self._specs, masks, root["amask"]):
            if amask is None:
                continue
            stuck = ~amask.any(-1) if mask is None else mask & ~amask.any(-1)
            if stuck.any():
                for e, s in np.argwhere(stuck):
                    self._checker.report(EnvOutputError("action mask allows no action", env_index=int(e),
                                                        agent=spec.agent_names[s], key=(spec.name, ACTION_MASK)))

    def _checked_root(self, root: dict) -> dict:
        """Checks a root with freshly reset rows; in lenient mode resets bad copies again (a few tries)."""
        for _ in range(_RESET_TRIES):
            self._check_obs(root["obs"], root["shared"], ())
            self._check_legal(root)
            errors = self._checker.take()
            if not errors:
                if root["mask"] is not None and all(m.all() for m in root["mask"]):
                    root["mask"] = None  # every agent present: constant masks (adapters.assembly)
                return root
            self._counters["invalid_reset_retries"] += 1
            for e in sorted({err.env_index for err in errors if err.env_index is not None}):
                self._reset_one(e, None, root)
        raise errors[0]

    def _actions(self, actions: TensorDictBase) -> tuple[list, list]:
        """Checked actions per group: ``(arrays, ints)``.

        ``arrays[g]``: one numpy array per action leaf (None for a ``Discrete`` group, or one absent everywhere);
        ``ints[g]``: for a ``Discrete`` group, the ``[E][A]`` nested list of Python ints, sent as they are
        (PettingZoo's bounds check, ``Discrete.contains``, takes an int without numpy's dtype tests), else None.
        """
        root = self._root
        if root is None:
            raise RuntimeError("call reset() before step()")
        arrays, ints = [], []
        for check, mask, amask, is_int in zip(self._action_checks, root["mask"] or self._no_masks, root["amask"],
                                              self._int_groups):
            if is_int:
                arrays.append(None)
                ints.append(check.int_lists(actions, mask, amask))
            else:
                arrays.append(check.arrays(actions, mask, amask))
                ints.append(None)
        return arrays, ints

    def _action_of(self, slot: _AgentSlot, e: int, arrays, ints=None):
        if ints is not None and slot.int_act:
            return ints[slot.group][e][slot.slot]
        leaves = arrays[slot.group]
        if slot.plain_act:
            return leaves[0][e, slot.slot]
        return slot.act.unflatten([a[e, slot.slot] for a in leaves], ())

    def _repair(self, nxt: dict, errors: list[EnvOutputError], present: list[np.ndarray] | None) -> np.ndarray:
        """Lenient repair (module doc of adapters.checking); returns the ``[E]`` mask of truncated copies."""
        bad = np.zeros(self._num_envs, dtype=bool)
        for err in errors:
            e = err.env_index
            if e is None:
                continue
            bad[e] = True
            slot = self._slots.get(err.agent)
            if slot is not None:  # the observation the agent acted on (padding if it had none)
                for buf, prev in zip(nxt["obs"][slot.group], self._root["obs"][slot.group]):
                    buf[e, slot.slot] = prev[e, slot.slot]
            elif err.key[:2] == (NEXT, SHARED) and nxt["shared"] is not None:
                for buf, prev in zip(nxt["shared"], self._root["shared"]):
                    buf[e] = prev[e]
        _, truncated = self._flags(nxt)
        for gi, reward in enumerate(nxt["reward"]):
            np.copyto(reward, 0.0, where=~np.isfinite(reward))
            truncated[gi][bad] |= True if present is None else present[gi][bad]
        self._checker.count_truncations(bad.sum())
        return bad

    def _finish(self, nxt: dict, root: dict, present: list[np.ndarray] | None, ended: list[int]) -> TensorDict:
        """Checks, repairs, resets ended copies and assembles the step (shared by Parallel and AEC).

        ``present``: the root masks of the input step (None: every agent); ``ended``: copies whose episode ended.
        """
        self._check_obs(nxt["obs"], nxt["shared"], (NEXT,))
        self._check_legal(root)
        for reward, (key, names) in zip(nxt["reward"], self._reward_keys):
            if self._reward_check.bad(reward, 2) is not None:
                self._checker.values(self._reward_check, reward, 2, key, names)
        env_ended = env_trunc = None
        if ended:
            env_ended = np.zeros(self._num_envs, dtype=bool)
            env_ended[ended] = True
            env_trunc = env_ended & np.any([t.any(-1) for t in nxt[TRUNCATED]], axis=0) \
                if nxt[TRUNCATED] is not None else np.zeros_like(env_ended)
        self.last_cut = AdapterBase.last_cut
        if self._checker.pending:
            # an episode the env ended with valid rewards is whole (only a final observation was repaired)
            whole = np.all([np.isfinite(r).all(axis=tuple(range(1, r.ndim))) for r in nxt["reward"]], axis=0)
            bad = self._repair(nxt, self._checker.take(), present)
            self.last_cut = np.flatnonzero(bad & ~(whole & (env_ended if env_ended is not None else False)))
            if env_ended is None:
                env_ended, env_trunc = bad, bad.copy()
            else:
                env_ended, env_trunc = env_ended | bad, env_trunc | bad
        if root["obs"] is None:  # observations after the step are the root ones (Parallel envs)
            # share "next"'s arrays unless a reset is about to write root rows
            root["obs"] = [[a.copy() for a in g] for g in nxt["obs"]] if env_ended is not None else nxt["obs"]
            if self._state is not None:
                root["shared"] = [a.copy() for a in nxt["shared"]] if env_ended is not None else nxt["shared"]
        if env_ended is not None:
            for e in np.flatnonzero(env_ended):
                self._reset_one(int(e), None, root)
            root = self._checked_root(root)
        self._root = root
        masks = present or self._no_masks
        if nxt[TERMINATED] is None:  # no agent ended: constant flags (adapters.assembly)
            groups_next = [GroupNext(obs, reward, None, None, mask)
                           for obs, reward, mask in zip(nxt["obs"], nxt["reward"], masks)]
        else:
            groups_next = [GroupNext(obs, reward, term, trunc, mask)
                           for obs, reward, term, trunc, mask in zip(nxt["obs"], nxt["reward"], nxt[TERMINATED],
                                                                      nxt[TRUNCATED], masks)]
        env_flags = (env_ended & ~env_trunc, env_trunc) if env_ended is not None else (None, None)
        return self._layout.build(self._group_steps(root), root["shared"], groups_next, nxt["shared"], *env_flags)

    def _group_steps(self, root: dict) -> list[GroupStep]:
        masks = root["mask"] or self._no_masks
        return [GroupStep(obs, mask, amask) for obs, mask, amask in zip(root["obs"], masks, root["amask"])]
