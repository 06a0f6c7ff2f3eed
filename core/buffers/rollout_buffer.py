"""Seed 001's ``MultiAgentRolloutBuffer`` API as a thin facade over fragments (one env, one group).

Each episode is one ``[1, T]`` fragment built by :class:`FragmentBuilder` (group ``"agents"`` with
``n_agents`` agents); statistics come from :func:`episode_stats`, per-agent views from
:func:`agent_trajectory`, batches from :func:`flatten_transitions` / :func:`minibatches`. No separate
logic lives here. Where seed 001 holds ``List[List[Tensor]]`` (outer: agents, inner: steps), the facade
returns a list over agents of ``[T, ...]`` tensors, which index the same way (``states[agent][t]``).

Mapping of seed names to the layout: ``states`` -> ``(g, "observation")``, ``actions`` -> ``(g, "action")``,
``log_probs`` -> ``(g, "log_prob")``, ``state_values`` -> ``(g, "state_value")``, ``rewards`` ->
``("next", g, "reward")``, ``next_states`` -> ``("next", g, "observation")``, ``next_state_values`` ->
``("next", g, "state_value")``, ``dones`` -> ``("next", g, "terminated")``, ``extras[k]`` -> ``(g, "extras", k)``.
An episode ends only at :meth:`end_episode`; agents not done by then are marked truncated.

Optional keys (``state_values`` with ``next_state_values``, and each ``extras[k]``) may come and go between
the transitions of an episode, as seed 001's per-step lists allowed; the facade keeps every step aligned
instead of letting lists drift apart. An episode stores the optional keys that any of its transitions gave:

- a transition that omits one the episode stores gets a *fill*: NaN for floating dtypes, zero (``False``)
  for integer and bool ones, in the dtype and shape that key was first given with;
- a transition that brings one the episode does not store yet widens the episode: its earlier steps get
  the fill, so ``state_values[agent][t]`` still indexes step ``t``;
- ``(g, "present", *key)`` ``[1, T, n]`` bool (``(g, "present", "state_value")``,
  ``(g, "present", "extras", k)``) records which steps really had the key; the seed views carry it as
  ``episode["present"]["state_values"]`` / ``episode["present"]["extras"][k]`` (per agent ``[T]`` bool).

A key that no transition of an episode gave is not stored at all (``episode["state_values"] == []``), as
before. Each episode has its own set of optional keys; :meth:`transitions` fills keys that only some
episodes store (present ``False``), so episodes with different keys still concatenate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from core.buffers.batching import flatten_transitions, minibatches
from core.buffers.episodes import agent_trajectory, episode_stats
from core.buffers.fragments import FragmentBuilder
from core.layout import (
    ACTION, DONE, LOG_PROB, NEXT, OBSERVATION, REWARD, STATE_VALUE, TERMINATED, TRUNCATED,
)

GROUP = "agents"
EXTRAS = "extras"
PRESENT = "present"
"""Group sub-key of the bool masks of optional keys: ``(GROUP, PRESENT, *key)`` is True where a step had ``key``."""

_Spec = dict[tuple[str, ...], tuple[tuple[int, ...], torch.dtype]]
"""Step paths of one optional key -> (shape past the env dim, dtype)."""


def _per_agent(value: Any, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Tensor ``[n, ...]`` from a tensor, a sequence, or a dict keyed by agent (0..n-1 or in order)."""
    if isinstance(value, Mapping):
        value = [value[i] for i in range(n)] if all(i in value for i in range(n)) else list(value.values())
    if not isinstance(value, torch.Tensor):
        value = torch.stack([torch.as_tensor(v) for v in value])
    if dtype is not None:
        value = value.to(dtype)
    if value.shape[0] != n:
        raise ValueError(f"expected values for {n} agents, got shape {tuple(value.shape)}")
    return value


def _fill(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The stand-in of an omitted optional key: NaN for floating (and complex) dtypes, else zero/False."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(tuple(shape), float("nan"), dtype=dtype)
    return torch.zeros(tuple(shape), dtype=dtype)


def _value_paths(key: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Step/fragment paths that hold the optional ``key`` (state values live under the group and ``"next"``)."""
    return [(GROUP, *key), (NEXT, GROUP, *key)] if key == (STATE_VALUE,) else [(GROUP, *key)]


def _optional_specs(fragment: TensorDict) -> dict[tuple[str, ...], _Spec]:
    """The optional keys a fragment stores (from its present masks), with their leaves' shapes and dtypes."""
    present = fragment.get((GROUP, PRESENT), None)
    if present is None:
        return {}
    specs = {}
    for key in present.keys(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        specs[key] = {path: (tuple(fragment.get(path).shape[2:]), fragment.get(path).dtype)
                      for path in _value_paths(key)}
    return specs


def _fill_missing_(fragment: TensorDict, specs: Mapping[tuple[str, ...], _Spec]) -> TensorDict:
    """Adds the optional keys of ``specs`` that ``fragment`` ``[E, T]`` lacks: fills, present ``False``."""
    batch = tuple(fragment.batch_size)
    for key, spec in specs.items():
        if (GROUP, PRESENT, *key) in fragment.keys(include_nested=True):
            continue
        for path, (tail, dtype) in spec.items():
            fragment.set(path, _fill((*batch, *tail), dtype))
        fragment.set((GROUP, PRESENT, *key), torch.zeros(*batch, fragment.get(GROUP).batch_size[-1], dtype=torch.bool))
    return fragment


class MultiAgentRolloutBuffer:
    """Episodes of ``n_agents`` agents, stored as fragments (stateful, like seed 001's buffer)."""

    def __init__(self, n_agents: int | None = None):
        self.n_agents: int | None = None
        self.episodes: list[dict[str, Any]] = []
        self.n_episodes = 0
        self.total_steps = 0
        self._builder: FragmentBuilder | None = None
        self._optional: dict[tuple[str, ...], _Spec] = {}  # optional keys of the episode in progress
        if n_agents is not None:
            self.reset(n_agents)

    def reset(self, n_agents: int) -> None:
        """Forgets every episode and starts over with ``n_agents`` agents."""
        if n_agents < 1:
            raise ValueError(f"n_agents must be >= 1, got {n_agents}")
        self.n_agents = n_agents
        self.episodes, self.n_episodes, self.total_steps = [], 0, 0
        self._builder = FragmentBuilder(1, group_sizes={GROUP: n_agents}, track_episodes=False)

    def reset_current_episode(self) -> None:
        """Discards the transitions of the episode in progress."""
        self._require().clear_()

    def add_transition(
        self,
        states: torch.Tensor,
        actions: torch.Tensor,
        log_probs: torch.Tensor,
        rewards: torch.Tensor | Mapping | Sequence,
        next_states: torch.Tensor,
        dones: torch.Tensor | Mapping | Sequence,
        state_values: torch.Tensor | None = None,
        next_state_values: torch.Tensor | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Adds one step of all agents: ``states``/``next_states`` ``[n, *obs]``, ``actions`` ``[n, *act]``,
        ``log_probs``/``rewards``/``dones``/values ``[n]`` or ``[n, 1]`` (rewards/dones may be dicts keyed by
        agent), ``extras[k]`` ``[n, ...]``. Values are stored only when both are given (as in seed 001).

        ``state_values`` (with ``next_state_values``) and each ``extras[k]`` are optional *per step*: one the
        episode stores but this step omits is filled (NaN for floating dtypes, zero for others) and marked
        absent in ``(g, "present", *key)``; one this step brings first is filled in at the episode's earlier
        steps the same way (see the module docstring). A key keeps the dtype it was first given with in the
        episode; giving it with another shape raises ``ValueError`` naming the key.
        """
        n = self._require_agents()

        def col(x, dtype=None):  # [n] or [n, 1] -> [1, n, 1]
            return _per_agent(x, n, dtype).reshape(1, n, 1)

        done = col(dones, torch.bool)
        group = {OBSERVATION: _per_agent(states, n).unsqueeze(0), ACTION: _per_agent(actions, n).unsqueeze(0),
                 LOG_PROB: col(log_probs)}
        nxt = {OBSERVATION: _per_agent(next_states, n).unsqueeze(0), REWARD: col(rewards, torch.float32),
               TERMINATED: done, TRUNCATED: torch.zeros_like(done), DONE: done}
        given: dict[tuple[str, ...], dict[tuple[str, ...], torch.Tensor]] = {}
        if state_values is not None and next_state_values is not None:
            given[(STATE_VALUE,)] = dict(zip(_value_paths((STATE_VALUE,)), (col(state_values), col(next_state_values))))
        for k, v in (extras or {}).items():
            try:
                given[(EXTRAS, k)] = {(GROUP, EXTRAS, k): _per_agent(v, n).unsqueeze(0)}
            except ValueError as err:
                raise ValueError(f"extras[{k!r}]: {err}") from None
        if len(self._require()) == 0:  # an episode's first step: its optional keys start afresh
            self._optional = {}
            self._new_builder()
        for key, values in given.items():  # check every key before changing anything
            for path, (tail, dtype) in self._optional.get(key, {}).items():
                if tuple(values[path].shape[1:]) != tail:
                    raise ValueError(f"{_seed_name(path)} has per-agent shape {tuple(values[path].shape[2:])}, "
                                     f"earlier steps of the episode gave {tail[1:]}")
                values[path] = values[path].to(dtype)
        for key, values in given.items():
            if key not in self._optional:
                self._widen_(key, {path: (tuple(v.shape[1:]), v.dtype) for path, v in values.items()})
        flag = torch.zeros(1, 1, dtype=torch.bool)  # the env episode ends only at end_episode()
        step = {GROUP: group, NEXT: {GROUP: nxt, DONE: flag, TERMINATED: flag, TRUNCATED: flag}}
        if self._optional:
            present: dict = {}
            group[PRESENT] = present
            for key, spec in self._optional.items():
                values = given.get(key)
                for path, (tail, dtype) in spec.items():
                    _set_path(step, path, values[path] if values is not None else _fill((1, *tail), dtype))
                _set_path(present, key, torch.full((1, n), values is not None, dtype=torch.bool))
        self._builder.add_step_(step)

    def end_episode(self) -> dict[str, Any]:
        """Closes the current episode, computes its statistics, appends it to ``episodes`` and returns it."""
        builder = self._require()
        fragment = builder.build(0, end_episodes=torch.ones(1, dtype=torch.bool))
        nxt = fragment.get(NEXT)
        all_terminated = nxt.get((GROUP, TERMINATED))[:, -1].all(1)  # [1, 1]: every agent ended for good
        nxt.get(TERMINATED)[:, -1] = all_terminated
        nxt.get(TRUNCATED)[:, -1] = ~all_terminated
        stats = episode_stats(fragment, GROUP)
        record = stats.get("episodes")[0]
        episode = self._seed_view(fragment)
        episode.update(
            episode_length=record.get("agent_length").tolist(),
            episode_reward=record.get("agent_return").squeeze(-1).tolist(),
            average_episode_length=float(record.get("agent_length").double().mean()),
            average_episode_reward=float(record.get("agent_return").mean()),
            fragment=fragment,
        )
        self.episodes.append(episode)
        self.n_episodes += 1
        self.total_steps += int(record.get("agent_length").sum())
        return episode

    @property
    def current_episode(self) -> dict[str, Any]:
        """Seed 001's view of the episode in progress (per-agent ``[t, ...]`` tensors and running sums)."""
        if len(self._require()) == 0:
            return self._seed_view(None)
        fragment = self._builder.peek()
        episode = self._seed_view(fragment)
        rewards = fragment.get((NEXT, GROUP, REWARD))[0].squeeze(-1)  # [t, n]
        episode.update(episode_length=[fragment.batch_size[1]] * self.n_agents,
                       episode_reward=rewards.sum(0).tolist())
        return episode

    @property
    def extras(self) -> dict[str, list[torch.Tensor]]:
        """Extras of the episode in progress: ``{name: [per-agent [t, ...] tensor]}``."""
        return self.current_episode[EXTRAS]

    @property
    def average_episode_length(self) -> float:
        """Mean over completed episodes of their per-agent average length (NaN when none)."""
        return _mean([ep["average_episode_length"] for ep in self.episodes])

    @property
    def average_episode_reward(self) -> float:
        """Mean over completed episodes of their per-agent average return (NaN when none)."""
        return _mean([ep["average_episode_reward"] for ep in self.episodes])

    def transitions(self) -> TensorDict:
        """Every transition of the completed episodes, ``[N]`` (group ``[N, n_agents]``).

        Optional keys stored by some episodes only are filled in the others (present ``False``)."""
        if not self.episodes:
            raise ValueError("no completed episodes")
        specs: dict[tuple[str, ...], _Spec] = {}
        for ep in self.episodes:
            for key, spec in _optional_specs(ep["fragment"]).items():
                specs.setdefault(key, spec)
        fragments = [ep["fragment"] for ep in self.episodes]
        if any(_optional_specs(f).keys() != specs.keys() for f in fragments):
            fragments = [_fill_missing_(f.copy(), specs) for f in fragments]  # shallow: stored episodes unchanged
        return torch.cat([flatten_transitions(f) for f in fragments], 0)

    def get_minibatches(self, minibatch_size: int, generator: torch.Generator) -> list[TensorDict]:
        """Shuffled minibatches of :meth:`transitions` (agents of a step stay together): every one holds
        ``minibatch_size`` transitions but the last, which holds the rest (:func:`core.buffers.batching.minibatches`)."""
        return minibatches(self.transitions(), minibatch_size, generator)

    def _seed_view(self, fragment: TensorDict | None) -> dict[str, Any]:
        n = self._require_agents()
        keys = {"states": OBSERVATION, "actions": ACTION, "log_probs": LOG_PROB, "state_values": STATE_VALUE,
                "rewards": (NEXT, REWARD), "next_states": (NEXT, OBSERVATION),
                "next_state_values": (NEXT, STATE_VALUE), "dones": (NEXT, TERMINATED)}
        view: dict[str, Any] = {name: [] for name in keys}
        view[EXTRAS] = {}
        view[PRESENT] = {"state_values": [], EXTRAS: {}}
        if fragment is None:
            return view
        for agent in range(n):
            traj = agent_trajectory(fragment, GROUP, 0, agent, present_only=False)
            for name, key in keys.items():
                value = traj.get(key, None)
                if value is not None:
                    squeeze = name in ("log_probs", "rewards", "dones") and value.shape[-1:] == (1,)
                    view[name].append(value.squeeze(-1) if squeeze else value)
            for k, v in traj.get(EXTRAS, TensorDict()).items():
                view[EXTRAS].setdefault(k, []).append(v)
            present = traj.get(PRESENT, TensorDict())
            if STATE_VALUE in present.keys():
                view[PRESENT]["state_values"].append(present.get(STATE_VALUE))
            for k, v in present.get(EXTRAS, TensorDict()).items():
                view[PRESENT][EXTRAS].setdefault(k, []).append(v)
        return view

    def _new_builder(self) -> None:
        """A builder with a fresh key layout that goes on with the old one's episode ids and sequence."""
        old = self._builder
        self._builder = FragmentBuilder(1, group_sizes={GROUP: self.n_agents}, track_episodes=False)
        self._builder.tracker, self._builder.sequence = old.tracker, old.sequence

    def _widen_(self, key: tuple[str, ...], spec: _Spec) -> None:
        """Adds optional ``key`` to the episode in progress: its steps so far get the fill, present False."""
        self._optional[key] = spec
        if len(self._builder) == 0:
            return
        steps = _fill_missing_(self._builder.peek(), {key: spec})
        self._new_builder()
        for t in range(steps.batch_size[1]):
            self._builder.add_step_(steps[:, t].to_dict())

    def _require(self) -> FragmentBuilder:
        if self._builder is None:
            raise RuntimeError("call reset(n_agents) first")
        return self._builder

    def _require_agents(self) -> int:
        self._require()
        return self.n_agents


def _seed_name(path: tuple[str, ...]) -> str:
    """Seed 001's argument name of an optional step path."""
    if path[-1] == STATE_VALUE:
        return "next_state_values" if path[0] == NEXT else "state_values"
    return f"extras[{path[-1]!r}]"


def _set_path(tree: dict, path: tuple[str, ...], value: torch.Tensor) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
