"""External episodes to fragments: what the server (:mod:`orchestration.external_server`) records.

Each ``act`` request of an external episode is one step; its consequences (rewards, agents that left, the
next observation of each agent) arrive with the episode's next request or its ``end``. A running episode
holds a *lane*: a :class:`core.buffers.FragmentBuilder` of one env row (``E = 1``) with its own worker id,
so fragments ``[1, T]`` reach the learners through the usual inbox and ledger. A lane outlives episodes:
the next episode that takes it continues its row (``("next", "done")`` separates them, as in any env).

Steps per episode (the :mod:`core.layout` of a one-env batched env, ``A`` = group capacity)::

    open   acted on, consequences unknown:  group observation [1, A, *obs], mask [1, A], action_mask?,
           action [1, A, *act], log_prob [1, A, 1]; shared [1, *]
    held   complete, not yet in the lane: kept one step back so that a disconnect can still mark it truncated
    lane   complete steps; every ``T`` of them make a fragment

Rules (docs/external-protocol.md): an agent's next observation is the one it sends with the episode's next
request; an agent absent there (or a truncated end without final observations) bootstraps from its own
observation, counted in ``approx_bootstraps``. A disconnect or a refused request ends the episode: the held
step becomes the last one, truncated; the open step's consequences are unknown, so it is dropped and counted
(``steps_lost``), and the episode counts as ``episodes_cut``. A fragment's policy version is the oldest of
its steps (each step keeps its own behaviour log-probability, which is what the losses read).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from adapters.external.messages import ProtocolError, to_array
from core.buffers import FragmentBuilder
from core.layout import (ACTION, ACTION_MASK, DONE, LOG_PROB, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED,
                         TRUNCATED)
from core.specs import DictNode, Leaf, Node, Tree, agent_index, groups, shared_observations, zeros
from orchestration.actor import episode_records
from orchestration.assignment import GroupAssignment
from orchestration.builder import worker_id_of

_NP = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
       torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
       torch.float64: np.float64, torch.bfloat16: np.float32}


# -- values of the tree ---------------------------------------------------------------------------------------
def _fits(got: np.dtype, want: np.dtype) -> bool:
    """Same dtype, a lossless conversion, or float to float (the doc's rule)."""
    return got == want or np.can_cast(got, want, "safe") or (got.kind == "f" and want.kind == "f")


def parse_value(value: Any, node: Node, what: str) -> Any:
    """One agent's observation (or a shared one) as numpy arrays of the node's dtypes and shapes.

    Raises:
        ProtocolError: ``spec_violation`` (non-fatal) naming ``what`` and the leaf at fault.
    """
    if isinstance(node, DictNode):
        if not isinstance(value, dict) or set(value) != set(node.children):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ProtocolError("spec_violation", f"{what}: expected a map with keys {sorted(node.children)}, got {got}",
                                fatal=False)
        return {k: parse_value(value[k], c, f"{what}/{k}") for k, c in node.children.items()}
    array = to_array(value, what)
    want = np.dtype(_NP[node.dtype])
    if tuple(array.shape) != tuple(node.shape):
        raise ProtocolError("spec_violation", f"{what}: shape {list(array.shape)}, the tree says {list(node.shape)}",
                            fatal=False)
    if not _fits(array.dtype, want):
        raise ProtocolError("spec_violation", f"{what}: dtype {array.dtype.name} does not convert without loss to the "
                                              f"tree's {want.name}", fatal=False)
    array = array.astype(want, copy=False)
    if want.kind == "f" and not np.isfinite(array).all():
        raise ProtocolError("spec_violation", f"{what}: holds NaN or infinity", fatal=False)
    return array


def action_value(action: Any, slot: int) -> Any:
    """The action of agent ``slot`` out of a group's ``[1, A, *act]`` action (tensor or tree) as numpy."""
    if isinstance(action, Mapping):
        return {k: action_value(v, slot) for k, v in action.items()}
    return action[0, slot].numpy()


def _zeros(node: Node, lead: tuple[int, ...]) -> Any:
    if isinstance(node, DictNode):
        return {k: _zeros(c, lead) for k, c in node.children.items()}
    return np.zeros((*lead, *node.shape), dtype=_NP[node.dtype])


def _write(buffer: Any, index: tuple, value: Any) -> None:
    if isinstance(buffer, dict):
        for k, b in buffer.items():
            _write(b, index, value[k])
    else:
        buffer[index] = value


def _tensors(tree_of_arrays: Any) -> Any:
    if isinstance(tree_of_arrays, dict):
        return {k: _tensors(v) for k, v in tree_of_arrays.items()}
    return torch.from_numpy(tree_of_arrays)


def _where(mask: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` on the agent slots where ``mask`` ([1, A]) holds, ``old`` elsewhere (trees recursively)."""
    if isinstance(new, dict):
        return {k: _where(mask, new[k], old[k]) for k in new}
    return torch.where(mask.reshape(*mask.shape, *([1] * (new.dim() - 2))), new, old)


@dataclass(slots=True)
class Request:
    """One ``act`` request, parsed: per group tensors ``[1, A, ...]`` plus its consequences for the open step."""

    observation: dict[str, Any]
    """group -> observation ``[1, A, *obs]`` (zeros where absent)."""
    mask: dict[str, torch.Tensor]
    """group -> ``[1, A]`` bool: agents that need a decision now."""
    action_mask: dict[str, torch.Tensor]
    """group -> ``[1, A, n]`` bool (discrete actions only; all True where the simulator sent none)."""
    shared: Any
    """``[1, *]`` shared observation, or None."""
    reward: dict[str, torch.Tensor]
    """group -> ``[1, A, 1]`` float32: rewards since the previous request (the open step's)."""
    left: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """group -> (terminated, truncated) ``[1, A, 1]`` bool: agents that left since the previous request."""
    agents: list[tuple[str, str, int]]
    """(agent, group, slot) of the agents asking, in request order."""


class TreeCodec:
    """The tree's agents, slots and leaves, for parsing requests and answering them.

    Raises:
        ValueError: a tree the external protocol does not serve (a shared observation below the root).
    """

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.groups = groups(tree)
        self.index = agent_index(tree)
        shared = shared_observations(tree)
        if set(shared) - {()}:
            raise ValueError(f"external environments support a shared observation on the root population only; the "
                             f"tree has them at {sorted('/'.join(p) for p in shared if p)}")
        self.shared: Node | None = shared.get(())
        template = zeros(tree, [1])
        self._empty_actions = {g: _plain(template.get((g, ACTION))) for g in self.groups}
        self.mask_size = {g: s.agent.action.n for g, s in self.groups.items()
                          if isinstance(s.agent.action, Leaf) and s.agent.action.kind == "discrete"}

    def empty_outputs(self, group: str) -> dict[str, Any]:
        """Action and log-prob entries of a step where nobody of ``group`` acts (zeros, all masked out)."""
        return {ACTION: self._empty_actions[group], LOG_PROB: torch.zeros(1, self.groups[group].capacity, 1)}

    def agent(self, name: Any, what: str) -> tuple[str, int]:
        if not isinstance(name, str) or name not in self.index:
            near = sorted(self.index)[:8]
            raise ProtocolError("spec_violation", f"{what}: unknown agent {name!r}; the tree's agents are {near}"
                                                  f"{' ...' if len(self.index) > 8 else ''}", fatal=False)
        return self.index[name]

    def parse_act(self, message: Mapping[str, Any], what: str) -> Request:
        """An ``act`` message's fields as tensors (see :class:`Request`); ProtocolError (non-fatal) if bad."""
        agents = message.get("agents")
        if not isinstance(agents, dict) or not agents:
            raise ProtocolError("bad_message", f"{what}: 'agents' must be a non-empty map agent -> entry", fatal=False)
        obs, mask, legal = {}, {}, {}
        for g, spec in self.groups.items():
            obs[g] = _zeros(spec.agent.observation, (1, spec.capacity))
            mask[g] = np.zeros((1, spec.capacity), dtype=bool)
            if g in self.mask_size:
                legal[g] = np.ones((1, spec.capacity, self.mask_size[g]), dtype=bool)
        asking = []
        for name, entry in agents.items():
            g, slot = self.agent(name, what)
            if not isinstance(entry, dict) or "observation" not in entry or not set(entry) <= {"observation",
                                                                                              "action_mask"}:
                raise ProtocolError("bad_message", f"{what}: agent {name!r}: an entry is {{observation, action_mask?}}",
                                    fatal=False)
            _write(obs[g], (0, slot), parse_value(entry["observation"], self.groups[g].agent.observation,
                                                  f"{what}: agent {name!r} observation"))
            mask[g][0, slot] = True
            if "action_mask" in entry:
                if g not in legal:
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r} sent an action_mask, but its action "
                                                          f"is not discrete", fatal=False)
                m = to_array(entry["action_mask"], f"{what}: agent {name!r} action_mask")
                if m.dtype != np.bool_ or m.shape != (self.mask_size[g],) or not m.any():
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r}: action_mask must be bool "
                                                          f"[{self.mask_size[g]}] with a legal action, got {m.dtype} "
                                                          f"{list(m.shape)}", fatal=False)
                legal[g][0, slot] = m
            asking.append((name, g, slot))
        shared = None
        if self.shared is not None:
            if "shared" not in message:
                raise ProtocolError("spec_violation", f"{what}: the tree declares a shared observation; send 'shared'",
                                    fatal=False)
            shared = _tensors(_lead(parse_value(message["shared"], self.shared, f"{what}: shared")))
        reward, left = self.consequences(message, what)
        return Request({g: _tensors(o) for g, o in obs.items()}, {g: torch.from_numpy(m) for g, m in mask.items()},
                       {g: torch.from_numpy(m) for g, m in legal.items()}, shared, reward, left, asking)

    def consequences(self, message: Mapping[str, Any], what: str):
        """``rewards`` and ``left`` of an ``act`` or ``end`` as per-group tensors ``[1, A, 1]``."""
        reward = {g: torch.zeros(1, s.capacity, 1) for g, s in self.groups.items()}
        term = {g: torch.zeros(1, s.capacity, 1, dtype=torch.bool) for g, s in self.groups.items()}
        trunc = {g: torch.zeros(1, s.capacity, 1, dtype=torch.bool) for g, s in self.groups.items()}
        rewards = message.get("rewards") or {}
        if not isinstance(rewards, dict):
            raise ProtocolError("bad_message", f"{what}: 'rewards' must be a map agent -> number", fatal=False)
        for name, r in rewards.items():
            g, slot = self.agent(name, f"{what}: rewards")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not np.isfinite(r):
                raise ProtocolError("spec_violation", f"{what}: reward of {name!r} must be a finite number, got {r!r}",
                                    fatal=False)
            reward[g][0, slot, 0] = float(r)
        left = message.get("left") or {}
        if not isinstance(left, dict):
            raise ProtocolError("bad_message", f"{what}: 'left' must be a map agent -> terminated|truncated", fatal=False)
        for name, how in left.items():
            g, slot = self.agent(name, f"{what}: left")
            if how not in ("terminated", "truncated"):
                raise ProtocolError("bad_message", f"{what}: left[{name!r}] must be 'terminated' or 'truncated', got "
                                                   f"{how!r}", fatal=False)
            (term if how == "terminated" else trunc)[g][0, slot, 0] = True
        return reward, {g: (term[g], trunc[g]) for g in self.groups}

    def parse_final(self, message: Mapping[str, Any], what: str) -> dict[str, tuple[Any, torch.Tensor]]:
        """``end``'s ``observations``: group -> (observation ``[1, A, *obs]``, given ``[1, A]``)."""
        given = message.get("observations") or {}
        if not isinstance(given, dict):
            raise ProtocolError("bad_message", f"{what}: 'observations' must be a map agent -> observation", fatal=False)
        out = {g: (_zeros(s.agent.observation, (1, s.capacity)), np.zeros((1, s.capacity), dtype=bool))
               for g, s in self.groups.items()}
        for name, value in given.items():
            g, slot = self.agent(name, f"{what}: observations")
            _write(out[g][0], (0, slot), parse_value(value, self.groups[g].agent.observation,
                                                     f"{what}: final observation of {name!r}"))
            out[g][1][0, slot] = True
        return {g: (_tensors(o), torch.from_numpy(m)) for g, (o, m) in out.items()}


def _plain(value: Any) -> Any:
    """A TensorDict as nested dicts of tensors (a tensor as it is)."""
    if isinstance(value, torch.Tensor):
        return value
    return {k: _plain(v) for k, v in value.items()}


def _lead(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lead(v) for k, v in value.items()}
    return value[None]


# -- lanes and episodes ---------------------------------------------------------------------------------------
class Lanes:
    """Lanes (one-row fragment builders) lent to running episodes, and the counters of the recording.

    Args:
        codec: the run's tree.
        assignment: group -> policies (external groups have one policy each).
        fragment_length: ``T``.
        deliver: called with ``(fragment [1, T], meta, completed episodes)`` for every fragment, from the
            connection thread that completed it.
    """

    def __init__(self, codec: TreeCodec, assignment: Mapping[str, GroupAssignment], fragment_length: int,
                 deliver: Callable[[Any, dict, dict], None]) -> None:
        split = [g for g, a in assignment.items() if a.single is None]
        if split:
            raise ValueError(f"external environments need one policy per group; groups {split} are split between "
                             f"policies (check policy_mapping)")
        self.codec, self.assignment, self.fragment_length, self.deliver = codec, dict(assignment), fragment_length, deliver
        self.policy_of = {g: a.single for g, a in assignment.items()}
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._builders: list[FragmentBuilder] = []
        self._versions: list[dict[str, int]] = []
        self.counters = dict(episodes_started=0, episodes_completed=0, episodes_cut=0, steps_recorded=0,
                             steps_lost=0, approx_bootstraps=0)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def take(self) -> int:
        with self._lock:
            self.counters["episodes_started"] += 1
            if self._free:
                return self._free.pop()
            lane = len(self._builders)
            self._builders.append(FragmentBuilder(1, worker_id=worker_id_of(lane, 0),
                                                  group_sizes={g: s.capacity for g, s in self.codec.groups.items()}))
            self._versions.append({})
            return lane

    def give_back(self, lane: int) -> None:
        with self._lock:
            self._free.append(lane)

    def push(self, lane: int, step: dict, versions: Mapping[str, int]) -> None:
        """Adds a complete step to ``lane`` (held by the calling thread's episode); builds the fragment at ``T``."""
        builder, seen = self._builders[lane], self._versions[lane]
        for g, v in versions.items():
            seen[g] = min(seen.get(g, v), v)
        builder.add_step_(step)
        self.count("steps_recorded")
        if len(builder) < self.fragment_length:
            return
        versions = dict(seen)
        fragment = builder.build(versions)
        seen.clear()
        episodes = episode_records(builder.pop_completed_episodes(), self.assignment)
        meta = {"fragment_id": int(fragment.get("fragment_id")[0, 0]), "worker_id": builder.worker_id,
                "sequence": builder.sequence - 1, "env_steps": self.fragment_length,
                "policy_versions": {self.policy_of[g]: v for g, v in versions.items()}}
        self.deliver(fragment, meta, episodes)

    @property
    def created(self) -> int:
        """Lanes made so far (at most the most episodes that ever ran at once)."""
        return len(self._builders)

    @property
    def idle(self) -> int:
        """Lanes no episode holds now."""
        return len(self._free)

    @property
    def pending_steps(self) -> int:
        """Steps recorded in lanes but not yet in a fragment."""
        return sum(len(b) for b in self._builders)


class Episode:
    """One external episode on a lane (module docstring); used by one connection thread at a time."""

    def __init__(self, lanes: Lanes, name: str) -> None:
        self.lanes, self.name = lanes, name
        self.lane = lanes.take()
        self.open: dict | None = None
        self.open_versions: dict[str, int] = {}
        self.held: tuple[dict, dict[str, int]] | None = None
        self.waiting = False  # an answer is owed for this episode's last request

    # -- steps ------------------------------------------------------------------------------------------------
    def consequences(self, request: Request) -> None:
        """Completes the open step with ``request`` (the next step's observations, the rewards, who left)."""
        if self.open is None:
            return
        nxt: dict[str, Any] = {}
        approx = 0
        for g, (term, trunc) in request.left.items():
            entry = self.open[g]
            was, now = entry[MASK], request.mask[g]
            approx += int((was & ~now & ~term.squeeze(-1)).sum())
            nxt[g] = {OBSERVATION: _where(now, request.observation[g], entry[OBSERVATION]),
                      REWARD: request.reward[g], TERMINATED: term, TRUNCATED: trunc, DONE: term | trunc, MASK: was}
        if approx:
            self.lanes.count("approx_bootstraps", approx)
        self._complete(nxt, request.shared, False, False)

    def act(self, request: Request, outputs: Mapping[str, Mapping[str, Any]], versions: Mapping[str, int]) -> None:
        """Opens the step just answered: group -> ``{action, log_prob}`` of the inference service."""
        step: dict[str, Any] = {}
        for g in self.lanes.codec.groups:
            entry = {OBSERVATION: request.observation[g], MASK: request.mask[g], ACTION: outputs[g][ACTION],
                     LOG_PROB: outputs[g][LOG_PROB]}
            if g in request.action_mask:
                entry[ACTION_MASK] = request.action_mask[g]
            step[g] = entry
        if request.shared is not None:
            step[SHARED] = request.shared
        self.open, self.open_versions = step, dict(versions)

    def end(self, outcome: str, reward: Mapping[str, torch.Tensor],
            final: Mapping[str, tuple[Any, torch.Tensor]]) -> None:
        """Ends the episode (``outcome``: terminated or truncated); gives the lane back."""
        if self.open is not None:
            terminated = outcome == "terminated"
            nxt, approx = {}, 0
            for g, entry in ((g, self.open[g]) for g in self.lanes.codec.groups):
                present = entry[MASK]
                obs, given = final[g]
                if not terminated:
                    approx += int((present & ~given).sum())
                flag = torch.full((*present.shape, 1), True, dtype=torch.bool)
                nxt[g] = {OBSERVATION: _where(given, obs, entry[OBSERVATION]), REWARD: reward[g],
                          TERMINATED: flag & terminated, TRUNCATED: flag & (not terminated), DONE: flag, MASK: present}
            if approx:
                self.lanes.count("approx_bootstraps", approx)
            self._complete(nxt, self.open.get(SHARED), terminated, not terminated)
        self._flush()
        self.lanes.count("episodes_completed")
        self.lanes.give_back(self.lane)

    def cut(self) -> None:
        """Ends the episode after a disconnect or a refused request (module docstring); gives the lane back."""
        if self.open is not None:
            self.lanes.count("steps_lost")
            self.open = None
        if self.held is not None:
            step, versions = self.held
            _truncate_(step)
            self.lanes.push(self.lane, step, versions)
            self.held = None
        self.lanes.count("episodes_cut")
        self.lanes.give_back(self.lane)

    def _complete(self, nxt: dict, shared_next: Any, terminated: bool, truncated: bool) -> None:
        step = self.open
        step[NEXT] = {**nxt, DONE: torch.tensor([[terminated or truncated]]), TERMINATED: torch.tensor([[terminated]]),
                      TRUNCATED: torch.tensor([[truncated]])}
        if SHARED in step:
            step[NEXT][SHARED] = shared_next if shared_next is not None else step[SHARED]
        if self.held is not None:
            self.lanes.push(self.lane, *self.held)
        self.held, self.open = (step, self.open_versions), None

    def _flush(self) -> None:
        if self.held is not None:
            self.lanes.push(self.lane, *self.held)
            self.held = None


def _truncate_(step: dict) -> None:
    """Marks a complete step the last of its episode, truncated (env level and every agent slot)."""
    nxt = step[NEXT]
    for key, value in list(nxt.items()):
        if isinstance(value, dict):
            cut = ~value[DONE]  # every slot, as FragmentBuilder's end_episodes does
            value[TRUNCATED] = value[TRUNCATED] | cut
            value[DONE] = value[DONE] | cut
    nxt[TRUNCATED] = nxt[TRUNCATED] | ~nxt[DONE]
    nxt[DONE] = torch.ones_like(nxt[DONE])


__all__ = ["Episode", "Lanes", "Request", "TreeCodec", "action_value", "parse_value"]
