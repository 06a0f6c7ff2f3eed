"""Machinery shared by the gymnasium adapters (:mod:`adapters.gymnasium_env`).

Subclasses step their env(s) and hand back numpy arrays ``[E, *leaf]``; the base class checks them
(:mod:`adapters.checking`), repairs them in lenient mode, resets finished envs (checking the reset observations
too) and assembles the step TensorDict (:mod:`adapters.assembly`).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from tensordict import TensorDict, TensorDictBase

from core.layout import ACTION_MASK, NEXT, OBSERVATION, REWARD
from core.specs import AgentNode, Leaf

from .action_masks import MASK_KEY, check_source, split_mask, unmaskable, without_mask
from .assembly import AdapterBase, GroupNext, GroupStep, StepLayout, action_mask_size
from .checking import ActionCheck, Checker, EnvOutputError, LeafCheck
from .spaces import SpaceCodec, space_to_node

AGENT = "agent"
_RESET_TRIES = 3


class _GymnasiumBase(AdapterBase):
    """Shared machinery: codecs, checks, the lenient repair, resets of finished envs, step assembly."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_envs: int, check: str,
                 action_mask: str = "auto") -> None:
        observation_space, self._mask_in_obs = split_mask(observation_space, check_source(action_mask))
        self._obs = SpaceCodec(observation_space, f"{AGENT}/{OBSERVATION}")
        self._act = SpaceCodec(action_space, f"{AGENT}/action")
        self._tree = AgentNode(observation=space_to_node(observation_space, f"{AGENT}/{OBSERVATION}"),
                               action=space_to_node(action_space, f"{AGENT}/action"))
        self._num_envs = num_envs
        self._layout = StepLayout(self._tree, num_envs)
        (self._group,) = self._layout.groups.values()
        self._mask_n = action_mask_size(self._group)  # None: no Discrete action, no mask to apply
        if self._mask_in_obs and self._mask_n is None:
            raise ValueError(unmaskable("the env", action_space, "observation"))
        self._info_mask = action_mask in ("auto", "info") and not self._mask_in_obs
        self._amask: np.ndarray | None = None  # [E, n] the root's legal actions; None until the env gives masks
        self._names = self._group.agent_names
        self._checks = [LeafCheck(c.leaf) for c in self._obs.leaves]
        self._reward_check = LeafCheck(Leaf.box(()), finite_only=True)
        self._action_check = ActionCheck(self._group, num_envs)
        self._checker = Checker(check)
        self._counters = self._checker.counters
        self._closed = False
        self._root: list[np.ndarray] | None = None  # last root observation, [E, 1, *leaf] per leaf
        self._views = [(num_envs, 1, *c.leaf.shape) for c in self._obs.leaves]
        self._obs_keys = [((AGENT, OBSERVATION, *c.key), (NEXT, AGENT, OBSERVATION, *c.key)) for c in self._obs.leaves]

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets every env (env ``i`` seeded ``seed + i``); batch ``[env]``."""
        self._root = self._reset_checked(None, seed)
        return self._layout.build([self._root_step(self._root)])

    def step(self, actions: TensorDictBase) -> TensorDict:
        """Applies ``actions[("agent", "action")]`` ``[env, 1, *act]``; see :mod:`adapters.protocol`."""
        if self._root is None:
            raise RuntimeError("call reset() before step()")
        legal = None if self._amask is None else self._amask[:, None]  # the root's masks: masked actions refused
        arrays = self._action_check.arrays(actions, None, legal)  # every env present
        nxt, reward, term, trunc, root, auto = self._env_step([a[:, 0] for a in arrays])
        return self._finish(nxt, reward, term, trunc, root, auto)

    # -- hooks ----------------------------------------------------------------------------------------------
    def _env_step(self, actions: list[np.ndarray]):
        """Steps the env(s); returns ``(next_obs, reward, terminated, truncated, root_obs | None, auto_reset | None)``.

        ``next_obs`` holds the final observation of finished envs; ``root_obs`` (arrays ``[E, *leaf]``) is given
        when the env already reset finished envs itself (``auto_reset`` ``[E]`` says which).
        """
        raise NotImplementedError

    def _reset_envs(self, mask: np.ndarray | None, seed: int | None) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Resets the envs of ``mask`` (all when None).

        Returns:
            The observation of every env (``[E, *leaf]`` per leaf), and the indices of the reset envs whose
            values still need the batched check (None: every reset env; the others were checked one by one).
        """
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------------------
    def _agent_view(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a.reshape(shape) for a, shape in zip(arrays, self._views)]

    def _check_obs(self, arrays: list[np.ndarray], after_step: bool, rows: np.ndarray | None = None) -> None:
        """Checks every env's observation (``"next"`` ones when ``after_step``), or only those of ``rows``."""
        for (root_key, next_key), check, arr in zip(self._obs_keys, self._checks, arrays):
            if rows is not None:
                arr = arr[rows]
            if check.bad(arr, 2) is not None:  # locate and report (values() checks again: the rare path)
                self._checker.values(check, arr, 2, next_key if after_step else root_key, self._names,
                                     env_rows=rows)

    def _reset_checked(self, mask: np.ndarray | None, seed: int | None) -> list[np.ndarray]:
        for _ in range(_RESET_TRIES):
            arrays, rows = self._reset_envs(mask, seed)
            root = self._agent_view(arrays)
            # only the reset rows are new (the others were checked as "next" already), minus those the
            # subclass checked one by one while resetting
            if rows is None and mask is not None:
                rows = np.flatnonzero(mask)
            if rows is None or rows.size:
                self._check_obs(root, False, rows)
            errors = self._checker.take()
            if not errors:
                return root
            self._counters["invalid_reset_retries"] += 1
            mask, seed = np.zeros(self._num_envs, dtype=bool), None
            mask[[err.env_index for err in errors]] = True
        raise errors[0]

    def _finish(self, nxt, reward, term, trunc, root, auto) -> TensorDict:
        e = self._num_envs
        nxt = self._agent_view(nxt)
        # a reward beyond float32 becomes Inf (numpy warns) and fails the check below
        reward = np.asarray(reward, dtype=np.float32).reshape(e, 1)
        self._check_obs(nxt, True)
        if self._reward_check.bad(reward, 2) is not None:
            self._checker.values(self._reward_check, reward, 2, (NEXT, AGENT, REWARD), self._names)
        self.last_cut = AdapterBase.last_cut
        if self._checker.pending:  # lenient (strict raised already): repair, truncate, count
            errors = self._checker.take()
            bad = np.zeros(e, dtype=bool)
            bad[[err.env_index for err in errors]] = True
            # an episode the env ended with a valid reward is whole (only its final observation was repaired)
            self.last_cut = np.flatnonzero(bad & ~((term | trunc) & np.isfinite(reward[:, 0])))
            keep = bad.reshape(e, 1)
            nxt = [np.where(keep.reshape(e, *[1] * (a.ndim - 1)), prev, a) for a, prev in zip(nxt, self._root)]
            reward = np.where(np.isfinite(reward), reward, 0.0)
            trunc = trunc | bad
            self._checker.count_truncations(bad.sum())
        done = term | trunc
        any_done = np.count_nonzero(done) > 0  # ~3x cheaper than done.any()
        need_reset = done if auto is None else done & ~auto
        if any_done and (auto is None or need_reset.any()):
            root = self._reset_checked(need_reset, None)  # other envs' rows come back unchanged (reset_mask)
        elif root is None:
            root = nxt  # nothing reset: the root is "next" (never written again: resets copy, see _reset_envs)
        else:
            root = self._agent_view(root)
            if auto.any():  # reset observations the vector env produced itself
                self._check_obs(root, False)
                if errors := self._checker.take():
                    self._counters["invalid_reset_retries"] += 1
                    again = np.zeros(e, dtype=bool)
                    again[[err.env_index for err in errors]] = True
                    root = self._reset_checked(again, None)
        self._root = root
        if any_done:  # one agent per env: the env flags are the agent's (one tensor each, see StepLayout.build)
            step = GroupNext(nxt, reward, term, trunc, None, done)
            return self._layout.build([self._root_step(root)], nxt=[step], env_terminated=term, env_truncated=trunc)
        step = GroupNext(nxt, reward, None, None, None)  # nothing ended: constant flags (adapters.assembly)
        return self._layout.build([self._root_step(root)], nxt=[step])

    def _root_step(self, root: list[np.ndarray]) -> GroupStep:  # every env present; masks as the env gave them
        return GroupStep(root, None, None if self._amask is None else self._amask[:, None].copy())

    # -- action masks (adapters.action_masks) ---------------------------------------------------------------
    def _unmasked(self, obs, info, rows) -> object:
        """``obs`` without its action mask; the masks of ``rows`` (the envs whose root ``obs`` is: an index
        array, or None for every env) taken from it or from ``info`` (a vector env's: one row per env, and
        ``"_action_mask"`` saying which have one; else one env's) into the root's masks. Those of ``rows``
        without one allow every action (a mask does not outlive the observation it came with)."""
        if self._amask is not None:
            self._amask[slice(None) if rows is None else rows] = True
        if self._mask_in_obs:
            obs, mask = without_mask(obs)
            if mask is None:
                self._checker.report(EnvOutputError("missing", env_index=None if rows is None else int(rows[0]),
                                                    agent=AGENT, key=(AGENT, OBSERVATION, MASK_KEY)))
                return obs
            if rows is not None and np.ndim(mask) == 2:  # a vector env's batch: the rows asked for
                mask = np.asarray(mask)[rows]
        elif self._info_mask and info and MASK_KEY in info:
            mask, given = info[MASK_KEY], info.get(f"_{MASK_KEY}")
            if given is not None:  # a vector env's info: only the envs that gave one
                rows = np.flatnonzero(given) if rows is None else np.asarray(rows)[np.asarray(given)[rows]]
                mask = np.asarray(mask)[rows]
        else:
            return obs
        self._set_masks(mask, rows)
        return obs

    def _set_masks(self, mask, rows) -> None:
        n, e = self._mask_n, self._num_envs
        where = np.arange(e) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
        if not len(where):
            return
        if n is None:
            self._checker.report(EnvOutputError(unmaskable("the env", None, "info"), env_index=int(where[0]),
                                                agent=AGENT, key=(AGENT, ACTION_MASK)))
            return
        mask = np.asarray(mask)
        try:
            if mask.dtype == object:  # rows gymnasium could not stack into one array (of other shapes)
                mask = np.stack(list(mask))
            mask = mask.reshape(len(where), n)
        except ValueError:
            self._checker.report(EnvOutputError(f"expected action mask shape ({n},), got {np.shape(mask)}",
                                                env_index=int(where[0]), agent=AGENT, key=(AGENT, ACTION_MASK)))
            return
        if self._amask is None:
            self._amask = np.ones((e, n), dtype=bool)
        self._amask[where] = mask
        for i in where[~self._amask[where].any(-1)]:
            self._checker.report(EnvOutputError("action mask allows no action", env_index=int(i), agent=AGENT,
                                                key=(AGENT, ACTION_MASK)))

    def close(self) -> None:
        """Closes the env; idempotent."""
        if not self._closed:
            self._closed = True
            self.env.close()
