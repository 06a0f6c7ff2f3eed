"""PettingZoo Parallel and AEC envs, many copies batched, as a :class:`~adapters.protocol.BatchedEnv`.

The tree comes from copy 0: a :class:`~core.specs.DictPopulation` with one named member per entry of
``possible_agents`` (``observation_space(agent)``, ``action_space(agent)``), grouped by
:func:`core.specs.groups` (name prefix and identical spaces: mpe2 ``simple_tag`` gives groups ``adversary``
and ``agent``). Agents in ``env.agents`` have ``(group, "mask")`` True; the others are padded (zero clamped
into the bounds), so agents join and leave through the mask.

- Action masks: an observation ``Dict`` with an ``"action_mask"`` entry loses it; the mask goes to
  ``(group, "action_mask")`` and the observation becomes the ``"observation"`` entry (or a Dict of the other
  entries). Otherwise ``infos[agent]["action_mask"]`` is used when present (``action_mask="auto"``). A masked
  action is never sent (:class:`~adapters.checking.IllegalActionError`).
- ``state()`` becomes the shared observation ``("shared",)``, every leaf tagged ``eval_only`` (centralised
  critics); it is left out when the env has no ``state_space`` or ``state()`` raises ``NotImplementedError``
  (probed once on copy 0 at construction, after a ``reset(seed=0)``).
- A copy whose agents are all gone is reset inside the step; its final observations stay under ``"next"``.
  Env-level flags: ``done`` = the episode ended, ``truncated`` = it ended and an agent was truncated at that
  step, ``terminated = done & ~truncated``. Per-agent flags are set at the step where each agent ends.
- Copies reset inside a step are reset with ``seed=None`` (the env's own generator goes on).

Checks (:mod:`adapters.checking`) also cover agents outside ``possible_agents``, agents that acted but got
no observation, agents present without an observation, agents that leave without a terminal flag, and
action masks that allow nothing.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from tensordict import TensorDict, TensorDictBase

from core.layout import NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import Payoff

from .checking import CheckMode, EnvOutputError
from .pettingzoo_base import _SCALAR_TYPES as _SCALARS, _PettingZooBase


class PettingZooParallelEnv(_PettingZooBase):
    """``num_envs`` copies of a PettingZoo ``ParallelEnv``, stepped in a loop over copies.

    Args:
        env_fn: builds one copy (e.g. ``mpe2.simple_spread_v3.parallel_env``); called ``num_envs`` times.
        num_envs: number of copies.
        check: ``"strict"`` or ``"lenient"`` (:mod:`adapters.checking`).
        payoff: payoff of the population (PettingZoo does not say): cooperative, zero_sum or general.
        action_mask: where masks come from: ``"auto"`` (observation dict, else info), ``"observation"``,
            ``"info"`` or ``"none"``.
        state: None probes ``state()``; False leaves it out.
    """

    def __init__(self, env_fn: Callable, num_envs: int = 1, *, check: CheckMode = "strict",
                 payoff: Payoff = "general", action_mask: str = "auto", state: bool | None = None) -> None:
        super().__init__(env_fn, num_envs, check=check, payoff=payoff, action_mask=action_mask, state=state)

    def _reset_one(self, e: int, seed: int | None, root: dict) -> None:
        env = self.envs[e]
        obs, infos = env.reset(seed=seed)
        self._clear_row(root, e)
        for agent, value in obs.items():
            if (slot := self._slot(e, agent, (OBSERVATION,))) is not None:
                self._write_obs(e, slot, value, root["obs"], root, infos.get(agent), None)
        for agent in env.agents:
            if (slot := self._slot(e, agent, (OBSERVATION,))) is not None:
                root["mask"][slot.group][e, slot.slot] = True
                if agent not in obs:
                    self._report(e, slot, "present without an observation", (), OBSERVATION)
        if self._state is not None:
            self._write_state(e, env, root["shared"], (SHARED,))

    def _report(self, e: int, slot, message: str, prefix: tuple[str, ...], what: str) -> None:
        key = (*prefix, self._specs[slot.group].name, what)
        self._checker.report(EnvOutputError(message, env_index=e, agent=slot.name, key=key))

    def step(self, actions: TensorDictBase) -> TensorDict:
        """Applies ``actions`` (batch ``[env]``) to every copy; see :mod:`adapters.protocol`."""
        present = self._root["mask"]  # never written again: resets write the new root's buffers
        arrays, ints = self._actions(actions)
        nxt, root = self._new_next(), self._new_root(obs=False, mask=False)  # root observations: see _finish
        slots, possible, reward, obs_bufs = self._slots, self._possible, nxt["reward"], nxt["obs"]
        info_mask = self._info_mask
        partial = []  # (copy, its live agents) where not every possible agent is live after the step
        for e, env in enumerate(self.envs):
            act = {}
            for agent in env.agents:
                slot = slots[agent]
                act[agent] = ints[slot.group][e][slot.slot] if slot.int_act else self._action_of(slot, e, arrays)
            out = env.step(act)
            if not (isinstance(out, (tuple, list)) and len(out) == 5):  # an old API's 4 values failed unpacking
                got = len(out) if isinstance(out, (tuple, list)) else type(out).__name__
                raise EnvOutputError(f"step() returned {got} values; a parallel env's step returns (observations, "
                                     f"rewards, terminations, truncations, infos), dicts by agent", env_index=e,
                                     agent=None, key=(NEXT,))
            obs, rewards, terms, truncs, infos = out
            for agent, value in obs.items():
                slot = slots.get(agent)
                plain = slot.plain_obs if slot is not None else None
                if (plain is not None and type(value) is np.ndarray and value.shape == plain[0]
                        and value.dtype == plain[1] and not (info_mask and infos.get(agent))):
                    obs_bufs[slot.group][0][e, slot.slot] = value
                elif (slot := self._slot(e, agent, (NEXT, OBSERVATION))) is not None:
                    self._write_obs(e, slot, value, obs_bufs, root, infos.get(agent), NEXT)
            for agent, value in rewards.items():
                if type(value) in _SCALARS and (slot := slots.get(agent)) is not None:
                    reward[slot.group][e, slot.slot] = value
                else:
                    self._write_reward(e, agent, value, nxt)
            if rewards.keys() != act.keys():  # every agent that acted gets its reward (0 would pass unseen)
                self._check_rewards(e, rewards, act)
            live = env.agents
            if any(terms.values()) or any(truncs.values()):
                self._write_flags(e, nxt, terms, truncs)
                for agent in live:  # PettingZoo removes a done agent (its parallel_api_test checks it)
                    if (terms.get(agent) or truncs.get(agent)) and agent in slots:
                        self._report(e, slots[agent], "is still in env.agents after the step that ended it "
                                     "(terminated or truncated): remove it from env.agents", (NEXT,), TERMINATED)
            if self._state is not None:
                self._write_state(e, env, nxt["shared"], (NEXT, SHARED))
            if live != possible:
                partial.append((e, list(live)))
            # usual case: the agents that acted are the live ones and each got an observation
            if not ((len(live) == len(act) and (live == possible or all(a in act for a in live)))
                    and obs.keys() == act.keys()):
                self._check_presence(e, obs, act, live, terms, truncs)
        self._mark_live(root, partial)
        ended = [e for e, live in partial if not live]
        return self._finish(nxt, root, present, ended)

    def _check_rewards(self, e: int, rewards, act) -> None:
        for agent in act:
            if agent not in rewards:
                slot = self._slots[agent]
                self._checker.report(EnvOutputError("no reward for an agent that acted (a parallel env's step returns "
                                                    "one for every agent that acted)", env_index=e, agent=slot.name,
                                                    key=(NEXT, self._specs[slot.group].name, REWARD)))

    def _mark_live(self, root: dict, partial: list) -> None:
        """Root masks of the copies in ``partial`` (``(copy, live agents)``); the others have every agent."""
        for e, live in partial:
            if root["mask"] is None:  # real masks only now: every other copy has every agent
                root["mask"] = [np.ones(s, dtype=bool) for s in self._batch_shapes]
            for mask in root["mask"]:
                mask[e] = False
            for agent in live:
                if (slot := self._slot(e, agent, (OBSERVATION,))) is not None:
                    root["mask"][slot.group][e, slot.slot] = True

    def _check_presence(self, e: int, obs, act, live, terms, truncs) -> None:
        """The slow path, when some agent acted or is present without an observation, or left."""
        for agent in act:
            slot = self._slots[agent]
            if agent not in obs:
                self._report(e, slot, "acted but got no observation", (NEXT,), OBSERVATION)
            if agent not in live and not (terms.get(agent) or truncs.get(agent)):
                self._report(e, slot, "left without terminated or truncated", (NEXT,), TRUNCATED)
        for agent in live:
            if agent not in obs and agent in self._slots:
                self._report(e, self._slots[agent], "present without an observation", (), OBSERVATION)


class PettingZooAECEnv(_PettingZooBase):
    """``num_envs`` copies of a turn-based PettingZoo ``AECEnv``; one protocol step = one move per copy.

    At every step exactly one agent per copy is present (``mask`` True): ``env.agent_selection``. A step
    plays its action, then advances the copy to the next agent that needs an action, stepping agents that
    are done with ``None`` (PettingZoo's removal steps) on the way; a copy whose live agents are all done is
    reset instead.

    Rewards: after each move ``env.rewards`` holds what *every* agent got from it (PettingZoo adds exactly
    that to ``_cumulative_rewards``); it is written into each agent's own slot of ``("next", group,
    "reward")`` at that step, present or not, so per-agent sums over an episode equal PettingZoo's returns,
    nothing lost or counted twice (removal steps clear ``env.rewards`` and are not read). Rewards that reach
    an agent while it waits (e.g. the loser of a board game after the winner's move) therefore sit at steps
    where its ``mask`` is False: a learner must credit them to the agent's previous move. Per-agent flags
    are likewise set for every agent at the move that ended it.

    Args: as :class:`PettingZooParallelEnv` (``env_fn`` builds an AEC env, e.g. ``connect_four_v3.env``).
    """

    def __init__(self, env_fn: Callable, num_envs: int = 1, *, check: CheckMode = "strict",
                 payoff: Payoff = "general", action_mask: str = "auto", state: bool | None = None) -> None:
        super().__init__(env_fn, num_envs, check=check, payoff=payoff, action_mask=action_mask, state=state)
        self._ended: list[set] = [set() for _ in range(num_envs)]

    @staticmethod
    def _advance(env) -> bool:
        """Steps done agents with None until a live one must act; True when the episode is over."""
        while env.agents:
            if all(env.terminations[a] or env.truncations[a] for a in env.agents):
                return True
            selected = env.agent_selection
            if not (env.terminations[selected] or env.truncations[selected]):
                return False
            env.step(None)
        return True

    def _flag_kinds_wrong(self, e: int, env) -> bool:
        """Whether some live agent's ``terminations`` / ``truncations`` entry is no flag (each reported); the step
        calls it only on an entry that is no ``bool`` (a numpy bool is a flag too)."""
        flags = (env.terminations, env.truncations)
        return any([self._not_a_flag(e, a, name, f[a]) for a in env.agents
                    for f, name in zip(flags, (TERMINATED, TRUNCATED))])

    def _write_turn(self, e: int, env, root: dict) -> None:
        agent = env.agent_selection
        if (slot := self._slot(e, agent, (OBSERVATION,))) is not None:
            root["mask"][slot.group][e, slot.slot] = True
            self._write_obs(e, slot, env.observe(agent), root["obs"], root, env.infos.get(agent), None)

    def _reset_one(self, e: int, seed: int | None, root: dict) -> None:
        env = self.envs[e]
        env.reset(seed=seed)
        self._ended[e] = set()
        self._clear_row(root, e)
        if self._flag_kinds_wrong(e, env):  # before reading them: a string "False" would end every agent
            return  # (once per episode: every entry checked)
        if self._advance(env):
            self._checker.report(EnvOutputError("no agent left to act after reset", env_index=e, agent=None,
                                                key=(OBSERVATION,)))
            return
        self._write_turn(e, env, root)
        if self._state is not None:
            self._write_state(e, env, root["shared"], (SHARED,))

    def step(self, actions: TensorDictBase) -> TensorDict:
        """Plays the present agent's action in every copy; see the class doc and :mod:`adapters.protocol`."""
        arrays, ints = self._actions(actions)
        present = self._root["mask"]  # never written again: resets write the new root's buffers
        nxt, root = self._new_next(), self._new_root()
        ended = []
        slots, reward = self._slots, nxt["reward"]
        for e, env in enumerate(self.envs):
            slot = slots[env.agent_selection]
            env.step(self._action_of(slot, e, arrays, ints))
            for agent, value in env.rewards.items():
                if type(value) in _SCALARS and (other := slots.get(agent)) is not None:
                    reward[other.group][e, other.slot] = value
                else:
                    self._write_reward(e, agent, value, nxt)
            self._write_obs(e, slot, env.observe(slot.name), nxt["obs"], None, None, NEXT)
            done, terms, truncs, wrong = self._ended[e], env.terminations, env.truncations, False
            for agent in env.agents:
                term, trunc = terms[agent], truncs[agent]
                if not (type(term) is bool and type(trunc) is bool) and (wrong := self._flag_kinds_wrong(e, env)):
                    break  # reported (lenient: the game is truncated): a string "False" would have ended them all
                if (term or trunc) and agent not in done:
                    done.add(agent)
                    if (other := self._slot(e, agent, (NEXT, TERMINATED))) is not None:
                        term_buf, trunc_buf = self._flags(nxt)
                        term_buf[other.group][e, other.slot] = bool(term)
                        trunc_buf[other.group][e, other.slot] = bool(trunc)
            if self._state is not None:
                self._write_state(e, env, nxt["shared"], (NEXT, SHARED))
            if wrong:
                continue
            if self._advance(env):
                ended.append(e)
            else:
                self._write_turn(e, env, root)
        if self._state is not None:
            root["shared"] = [a.copy() for a in nxt["shared"]]  # dead-agent steps do not change the state
        return self._finish(nxt, root, present, ended)


__all__ = ["PettingZooAECEnv", "PettingZooParallelEnv"]
