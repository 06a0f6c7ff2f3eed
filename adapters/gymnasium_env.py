"""Gymnasium envs as a :class:`~adapters.protocol.BatchedEnv`: one agent per env, group ``"agent"``.

The tree is an :class:`~core.specs.AgentNode` (a one-member population, so ``core.specs.groups`` names the
group ``"agent"`` with capacity 1): observations ``("agent", "observation")`` ``[env, 1, *obs]``, rewards
``("next", "agent", "reward")`` ``[env, 1, 1]``. A group whose action is one ``Discrete`` also gets an
``("agent", "action_mask")``: the masks the env gives in its observation ``Dict`` or ``info``
(:mod:`adapters.action_masks`), else all True, so steps match ``core.specs.zeros(tree)``.

Autoreset (see :class:`GymnasiumVectorEnv`): whatever the vector env's mode, a finished env's final
observation lands under ``"next"`` and its reset observation at the root of the *same* step; no transition
with an ignored action is ever produced. Checks and the two check modes: :mod:`adapters.checking`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv

from core.layout import NEXT, OBSERVATION, REWARD, TERMINATED, TRUNCATED

from .action_masks import without_mask
from .checking import CheckMode, EnvOutputError
from .gymnasium_base import AGENT, _GymnasiumBase
from .gymnasium_first_calls import check_first_calls


class GymnasiumEnv(_GymnasiumBase):
    """One ``gymnasium.Env`` as a batch of one env (``num_envs == 1``), with full per-sample checks.

    Unlike a vector env (which casts dtypes and refuses wrong shapes itself), every raw output is checked
    here: shape, dtype, NaN/Inf, bounds, reward and flag types.

    Args:
        env: the env; closed by :meth:`close`.
        check: ``"strict"`` or ``"lenient"`` (:mod:`adapters.checking`).
        action_mask: where its action masks come from (:mod:`adapters.action_masks`).
    """

    def __init__(self, env: gym.Env, *, check: CheckMode = "strict", action_mask: str = "auto") -> None:
        super().__init__(env.observation_space, env.action_space, 1, check, action_mask)
        self.env = env

    def _sample(self, obs, key: tuple[str, ...]) -> list[np.ndarray]:
        bufs = self._obs.buffers((1,))
        if (problem := self._obs.write(obs, bufs, 0)) is not None:
            leaf_key, message = problem
            self._checker.report(EnvOutputError(message, env_index=0, agent=AGENT, key=(*key, *leaf_key)))
        return bufs

    def _reset_envs(self, mask, seed):
        obs, info = self.env.reset(seed=seed)
        return self._sample(self._unmasked(obs, info, None), (AGENT, OBSERVATION)), None

    def _env_step(self, actions):
        obs, reward, term, trunc, info = self.env.step(self._act.unflatten([a[0] for a in actions], ()))
        nxt = self._sample(self._unmasked(obs, info, None), (NEXT, AGENT, OBSERVATION))
        reward = self._scalar(reward, (NEXT, AGENT, REWARD), real=True)
        return (nxt, reward, self._scalar(term, (NEXT, AGENT, TERMINATED)),
                self._scalar(trunc, (NEXT, AGENT, TRUNCATED)), None, None)

    def _scalar(self, value, key, real: bool = False) -> np.ndarray:
        arr = np.asarray(value)
        kinds = "biuf" if real else "b"
        if arr.shape != () or arr.dtype.kind not in kinds:
            what = "a real number" if real else "a bool"
            self._checker.report(EnvOutputError(f"expected {what}, got {value!r}", env_index=0, agent=AGENT,
                                                key=key))
            return np.zeros(1, dtype=np.float64 if real else bool)
        return arr.reshape(1).astype(np.float64 if real else bool)


class GymnasiumVectorEnv(_GymnasiumBase):
    """A ``gymnasium.vector.VectorEnv`` (Sync or Async, any autoreset mode) in Shoal's semantics.

    - ``DISABLED``: finished envs are reset with ``reset(options={"reset_mask": done})`` in the same step.
    - ``SAME_STEP``: the final observation comes from ``info["final_obs"]``, the reset one from the step.
    - ``NEXT_STEP``: the same partial reset as DISABLED, issued right away; gymnasium's ``reset_mask`` clears
      the sub-env's pending autoreset, so its dummy step never happens. (``AsyncVectorEnv(shared_memory=False)``
      does not clear it, a gymnasium bug, and is refused in NEXT_STEP mode.)

    Fast path (NEXT_STEP / DISABLED on an unwrapped ``SyncVectorEnv``): finished sub-envs are reset directly
    (``env.envs[i].reset()``) and the vector env's pending-autoreset flag is cleared, instead of a batched
    ``reset(options={"reset_mask": ...})``, which re-concatenates and deep-copies every observation on most
    steps. It writes gymnasium 1.x private state (``_autoreset_envs``, ``_env_obs``); without it the public
    path is used.

    Gymnasium itself casts dtypes and raises ``ValueError`` on wrong shapes while batching, so only values
    (NaN/Inf, bounds, rewards) are checked here; :class:`GymnasiumEnv` checks everything.

    Args:
        env: the vector env; closed by :meth:`close`.
        check: ``"strict"`` or ``"lenient"`` (:mod:`adapters.checking`).
        action_mask: where its action masks come from (:mod:`adapters.action_masks`).
    """

    def __init__(self, env: VectorEnv, *, check: CheckMode = "strict", action_mask: str = "auto") -> None:
        super().__init__(env.single_observation_space, env.single_action_space, env.num_envs, check, action_mask)
        self.env = env
        base = env.unwrapped
        self.autoreset_mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        if (self.autoreset_mode == AutoresetMode.NEXT_STEP and isinstance(base, AsyncVectorEnv)
                and not base.shared_memory):
            raise ValueError("AsyncVectorEnv(shared_memory=False) in NEXT_STEP mode keeps a sub-env's pending "
                             "autoreset after reset(options={'reset_mask': ...}) (gymnasium _async_worker), so "
                             "its next action would be ignored; use shared_memory=True, SAME_STEP or DISABLED")
        self._copy = not getattr(base, "copy", True)  # the env reuses its arrays: copy them before wrapping
        self._batch = (env.num_envs,)
        self._base = base
        self._direct = (env is base and isinstance(base, SyncVectorEnv) and hasattr(base, "_autoreset_envs")
                        and hasattr(base, "_env_obs") and self.autoreset_mode != AutoresetMode.SAME_STEP)
        self._current: list[np.ndarray] | None = None  # latest observation of every env, [E, *leaf]
        for index, sub_env in enumerate(base.envs if isinstance(base, SyncVectorEnv) else ()):
            check_first_calls(sub_env, index)  # a vector env stores what they return without looking

    def _flat(self, obs) -> list[np.ndarray]:
        arrays = self._obs.flatten(obs, self._batch)
        return [np.array(a) for a in arrays] if self._copy else arrays

    def _reset_envs(self, mask, seed):
        if mask is not None and seed is None and self._direct and self._current is not None:
            arrays = [a.copy() for a in self._current]
            plain, quick = self._obs.plain, self._checks[0].quick_ok
            unchecked = []
            for i in np.flatnonzero(mask).tolist():
                obs, info = self._base.envs[i].reset()
                self._base._autoreset_envs[i] = False  # no NEXT_STEP dummy step, no DISABLED assertion
                self._base._env_obs[i] = obs
                obs = self._unmasked(obs, info, [i])
                if plain is not None and type(obs) is np.ndarray and obs.shape == plain[0] and obs.dtype == plain[1]:
                    arrays[0][i] = obs  # the usual case: one array leaf of the right shape and dtype
                    if not quick(obs):  # values not known to be fine: the batched check locates the problem
                        unchecked.append(i)
                    continue
                unchecked.append(i)
                if (problem := self._obs.write(obs, arrays, i)) is not None:
                    self._checker.report(EnvOutputError(problem[1], env_index=int(i), agent=AGENT,
                                                        key=(AGENT, OBSERVATION, *problem[0])))
            rows = np.array(unchecked, dtype=np.int64)
        else:
            options = None if mask is None else {"reset_mask": mask.copy()}
            try:
                arrays = self._flat(self._unmasked(*self.env.reset(seed=seed, options=options),
                                                   None if mask is None else np.flatnonzero(mask)))
            except ValueError as error:  # as in a step
                raise self._misfit(error, after_step=False) from None
            rows = None
        self._current = arrays
        return arrays, rows

    def _env_step(self, actions):
        try:
            obs, reward, term, trunc, info = self.env.step(self._act.unflatten(actions, self._batch))
        except ValueError as error:  # gymnasium could not stack the sub-envs' observations
            raise self._misfit(error) from None
        obs = self._unmasked(obs, info, None)
        if self.autoreset_mode != AutoresetMode.SAME_STEP:
            self._current = self._flat(obs)
            return self._current, reward, term, trunc, None, None
        root = self._flat(obs)
        auto = term | trunc
        if not auto.any():
            return root, reward, term, trunc, None, None
        nxt = [np.array(a) for a in root]  # final observations replace the reset ones in "next"
        for i in np.flatnonzero(auto):
            final = info["final_obs"][i]
            self._obs.write(without_mask(final)[0] if self._mask_in_obs else final, nxt, i)
        return nxt, reward, term, trunc, root, auto


    def _misfit(self, error: ValueError, after_step: bool = True) -> Exception:
        """What a failed step or reset raises: an :class:`EnvOutputError` naming the first sub-env whose observation
        does not fit the observation space (a ``SyncVectorEnv`` keeps each one's); after a step whose observations
        all fit, one naming the scalars gymnasium could not store (a reward or flag that is not one number: the
        vector env keeps no trace of which sub-env sent it); else ``error`` itself."""
        each = getattr(self._base, "_env_obs", None)
        if not isinstance(each, list):
            return error
        scratch = self._obs.buffers(self._batch)
        for i, obs in enumerate(each):
            obs = without_mask(obs)[0] if self._mask_in_obs and obs is not None else obs
            if obs is not None and (problem := self._obs.write(obs, scratch, i)) is not None:
                return EnvOutputError(problem[1], env_index=i, agent=AGENT,
                                      key=(*((NEXT,) if after_step else ()), AGENT, OBSERVATION, *problem[0]))
        if after_step and "array element with a sequence" in str(error):
            return EnvOutputError(f"a sub-env's step returned a reward, terminated or truncated that is not one number "
                                  f"(gymnasium's vector env could not store it: {error}); step() returns a real reward "
                                  f"and two bools", env_index=None, agent=AGENT, key=(NEXT, AGENT, REWARD))
        return error


def make_gymnasium(env_id: str, num_envs: int = 1, *, vectorization: str = "sync", check: CheckMode = "strict",
                   action_mask: str = "auto", **kwargs: Any) -> GymnasiumEnv | GymnasiumVectorEnv:
    """Builds ``num_envs`` copies of ``gymnasium.make(env_id, **kwargs)`` behind the batched protocol.

    ``"sync"`` keeps gymnasium's default NEXT_STEP mode and resets finished sub-envs directly (the fast path
    of :class:`GymnasiumVectorEnv`); ``"async"`` runs in SAME_STEP mode, where sub-env processes reset
    themselves (a batched partial reset would cost one more round trip to every process).

    Args:
        env_id: a registered gymnasium id, e.g. ``"CartPole-v1"``.
        num_envs: number of envs.
        vectorization: ``"sync"`` (:class:`SyncVectorEnv`), ``"async"`` (:class:`AsyncVectorEnv`, one process
            per env) or ``"none"`` (a single :class:`GymnasiumEnv`, ``num_envs`` must be 1).
        check: ``"strict"`` or ``"lenient"``.
        action_mask: where the env's action masks come from (:mod:`adapters.action_masks`).
        **kwargs: passed to ``gymnasium.make``.
    """
    if vectorization == "none":
        if num_envs != 1:
            raise ValueError(f"vectorization='none' wraps one env, got num_envs={num_envs}")
        return GymnasiumEnv(gym.make(env_id, **kwargs), check=check, action_mask=action_mask)
    fns = [partial(gym.make, env_id, **kwargs)] * num_envs
    if vectorization == "sync":
        vec = SyncVectorEnv(fns)
    elif vectorization == "async":
        vec = AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    else:
        raise ValueError(f"vectorization must be 'sync', 'async' or 'none', got {vectorization!r}")
    return GymnasiumVectorEnv(vec, check=check, action_mask=action_mask)


__all__ = ["AGENT", "GymnasiumEnv", "GymnasiumVectorEnv", "make_gymnasium"]
