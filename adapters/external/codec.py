"""The external-environment protocol's values against a Shoal tree (docs/external-protocol.md): observations,
action masks, rewards and actions of protocol messages as per-group tensors ``[1, A, ...]``, and back.

Used by the server (:mod:`orchestration.external_server`), by :mod:`adapters.external.local_policy` (a
simulator that acts with its own copy of the policy) and by the conformance kit. Every check names the
message, agent and leaf at fault in a non-fatal :class:`~adapters.external.messages.ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from adapters.external.messages import ProtocolError, from_array, to_array
from core.layout import ACTION, LOG_PROB, all_true
from core.specs import DictNode, Leaf, Node, Tree, agent_index, groups, iter_leaves, shared_observations, zeros

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
    if not isinstance(value, dict) and not isinstance(value, bool) and not node.shape:
        exact = array.astype(want)  # a plain number: judged by its value (an int 3 fits any int or float leaf)
        if exact.astype(array.dtype) != array if want.kind != "f" else False:
            raise ProtocolError("spec_violation", f"{what}: {value!r} does not fit the tree's {want.name}", fatal=False)
        array = exact
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


def _plain_leaf(node: Leaf) -> tuple:
    """What :func:`_read_plain` compares an observation of ``node`` with."""
    want = np.dtype(_NP[node.dtype])
    return (want.name, list(node.shape), tuple(node.shape), want.itemsize * int(np.prod(node.shape, dtype=np.int64)),
            want.newbyteorder("<"), want.kind == "f")


def _read_plain(value: Any, name: str, shape: list, dims: tuple, nbytes: int, little: np.dtype,
                finite: bool) -> np.ndarray | None:
    """The common case of :func:`parse_value` for a leaf, fast: an array map of exactly the leaf's dtype and
    shape, with the right byte count (and finite, for floats), as a read-only view of its bytes; None for
    anything else, which :func:`parse_value` then accepts or refuses with its named error."""
    if type(value) is not dict or value.get("dtype") != name:
        return None
    got, data = value.get("shape"), value.get("data")
    if type(got) is not list or got != shape or type(data) is not bytes or len(data) != nbytes \
            or any(type(d) is not int for d in got):
        return None
    array = np.frombuffer(data, little).reshape(dims)
    return array if not finite or np.isfinite(array).all() else None


def action_value(action: Any, slot: int) -> Any:
    """The action of agent ``slot`` out of a group's ``[1, A, *act]`` action (tensor or tree) as numpy."""
    if isinstance(action, Mapping):
        return {k: action_value(v, slot) for k, v in action.items()}
    value = action[0, slot]
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()  # numpy has no bfloat16


def action_maps(actions: Mapping[str, Any], agents: list[tuple[str, str, int]]) -> dict[str, Any]:
    """agent -> its action as the protocol sends it, for the ``(agent, group, slot)`` of ``agents``, out of
    group -> ``[1, A, *act]`` ``actions``: what :func:`action_value` and :func:`encode` give, with one numpy
    view per group tensor instead of a tensor index per agent (a tree action goes through :func:`action_value`)."""
    arrays: dict[str, Any] = {}
    out = {}
    for agent, g, slot in agents:
        action = actions[g]
        if not isinstance(action, torch.Tensor):
            out[agent] = action_value(action, slot)
            continue
        if g not in arrays:
            arrays[g] = (action.float() if action.dtype == torch.bfloat16 else action).numpy()
        out[agent] = from_array(arrays[g][0, slot])
    return out


def _check_action(value: Any, node: Node, legal: torch.Tensor | None, slot: int, what: str) -> None:
    """Raises unless an uploaded action lies in its space (and is legal under the agent's action mask)."""
    if isinstance(node, DictNode):
        for k, c in node.children.items():
            _check_action(value[k], c, None, slot, f"{what}/{k}")
        return
    bad = False
    if node.kind == "discrete":
        bad = not node.start <= int(value) < node.start + node.n
        if not bad and legal is not None:
            bad = not bool(legal[0, slot, int(value) - node.start])
    elif node.kind == "multi_discrete":
        bad = bool(((value < 0) | (value >= np.asarray(node.nvec))).any())
    elif node.kind == "binary":
        bad = bool(((value != 0) & (value != 1)).any())
    elif value.dtype.kind == "f":
        bad = not bool(np.isfinite(value).all())
    if bad:
        raise ProtocolError("spec_violation", f"{what}: action {value.tolist()} is outside its {node.kind} space "
                                              f"(or illegal under its action_mask)", fatal=False)


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


def where_slots(mask: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` on the agent slots where ``mask`` ([1, A]) holds, ``old`` elsewhere (trees recursively)."""
    if isinstance(new, dict):
        return {k: where_slots(mask, new[k], old[k]) for k in new}
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
    left: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """group -> (terminated, truncated, done) ``[1, A, 1]`` bool: agents that left since the previous request
    (``done`` = either)."""
    agents: list[tuple[str, str, int]]
    """(agent, group, slot) of the agents asking, in request order."""

    def inputs(self, group: str) -> dict[str, Any]:
        """``group``'s request to the inference service: observation, agent mask and (when sent) action mask."""
        out = {"observation": self.observation[group], "mask": self.mask[group]}
        if group in self.action_mask:
            out["action_mask"] = self.action_mask[group]
        return out

    def groups_asking(self) -> list[str]:
        """The groups with an agent asking, in the tree's order (``mask[g].any()``, without a tensor op)."""
        asking = {g for _, g, _ in self.agents}
        return [g for g in self.mask if g in asking]

    def slots(self) -> dict[str, set[int]]:
        """group -> slots of the agents asking (where ``mask[g]`` holds), as Python sets."""
        out: dict[str, set[int]] = {g: set() for g in self.mask}
        for _, g, slot in self.agents:
            out[g].add(slot)
        return out


class TreeCodec:
    """The tree's agents, slots and leaves, for parsing requests and answering them.

    Raises:
        ValueError: a tree the external protocol does not serve (a shared observation below the root).
    """

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.groups = groups(tree)  # refuses an agent name used twice (agents are keyed by name alone)
        self.index = agent_index(tree)
        shared = shared_observations(tree)
        if set(shared) - {()}:
            raise ValueError(f"external environments support a shared observation on the root population only; the "
                             f"tree has them at {sorted('/'.join(p) for p in shared if p)}")
        self.shared: Node | None = shared.get(())
        template = zeros(tree, [1])
        self._empty_actions = {g: _plain(template.get((g, ACTION))) for g in self.groups}
        self._plain = {g: _plain_leaf(s.agent.observation) for g, s in self.groups.items()
                       if isinstance(s.agent.observation, Leaf) and s.agent.observation.dtype in _NP
                       and s.agent.observation.dtype not in (torch.bool, torch.bfloat16)}
        self._layout = [(g, s.agent.observation, s.capacity) for g, s in self.groups.items()]
        self._no_reward = {g: torch.zeros(1, s.capacity, 1) for g, s in self.groups.items()}
        no = {g: torch.zeros(1, s.capacity, 1, dtype=torch.bool) for g, s in self.groups.items()}
        self._nobody_left = {g: (f, f, f) for g, f in no.items()}
        self.mask_size = {g: s.agent.action.n for g, s in self.groups.items()
                          if isinstance(s.agent.action, Leaf) and s.agent.action.kind == "discrete"}
        # where no agent sent an action_mask: one shared all-True constant, which policies know not to apply
        self._all_legal = {g: all_true(1, self.groups[g].capacity, n) for g, n in self.mask_size.items()}

    def empty_outputs(self, group: str) -> dict[str, Any]:
        """Action and log-prob entries of a step where nobody of ``group`` acts (zeros, all masked out)."""
        return {ACTION: self._empty_actions[group], LOG_PROB: torch.zeros(1, self.groups[group].capacity, 1)}

    def agent(self, name: Any, what: str) -> tuple[str, int]:
        if not isinstance(name, str) or name not in self.index:
            near = sorted(self.index)[:8]
            raise ProtocolError("spec_violation", f"{what}: unknown agent {name!r}; the tree's agents are {near}"
                                                  f"{' ...' if len(self.index) > 8 else ''}", fatal=False)
        return self.index[name]

    def parse_act(self, message: Mapping[str, Any], what: str, *, acted: bool = False) -> Request:
        """An ``act`` message's fields as tensors (see :class:`Request`); ProtocolError (non-fatal) if bad.
        ``acted``: a step of an uploaded trajectory, whose agent entries also hold ``action`` and ``log_prob``
        (read by :meth:`parse_outputs`)."""
        keys = {"observation", "action_mask", *(("action", "log_prob") if acted else ())}
        agents = message.get("agents")
        if not isinstance(agents, dict) or not agents:
            raise ProtocolError("bad_message", f"{what}: 'agents' must be a non-empty map agent -> entry", fatal=False)
        obs, mask, legal = {}, {}, {}  # legal: only groups where an agent sent its action_mask
        for g, node, capacity in self._layout:
            obs[g] = _zeros(node, (1, capacity))
            mask[g] = np.zeros((1, capacity), dtype=bool)
        asking = []
        for name, entry in agents.items():
            g, slot = self.agent(name, what)
            if not isinstance(entry, dict) or "observation" not in entry or not set(entry) <= keys:
                raise ProtocolError("bad_message", f"{what}: agent {name!r}: an entry holds {sorted(keys)} "
                                                   f"(observation required), got {sorted(entry) if isinstance(entry, dict) else entry!r}",
                                    fatal=False)
            value, plain = entry["observation"], self._plain.get(g)
            array = _read_plain(value, *plain) if plain is not None else None
            if array is None:  # not a plain array map of exactly the leaf's dtype and shape: checked in full
                array = parse_value(value, self.groups[g].agent.observation, f"{what}: agent {name!r} observation")
            _write(obs[g], (0, slot), array)
            mask[g][0, slot] = True
            if "action_mask" in entry:
                if g not in self.mask_size:
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r} sent an action_mask, but its action "
                                                          f"is not discrete", fatal=False)
                m = to_array(entry["action_mask"], f"{what}: agent {name!r} action_mask")
                if m.dtype != np.bool_ or m.shape != (self.mask_size[g],):
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r}: action_mask must be bool "
                                                          f"[{self.mask_size[g]}], got {m.dtype} {list(m.shape)}",
                                        fatal=False)
                if not m.any():
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r}: action_mask allows no action "
                                                          f"(all False): an agent that needs a decision has a legal "
                                                          f"one", fatal=False)
                if g not in legal:
                    legal[g] = np.ones((1, self.groups[g].capacity, self.mask_size[g]), dtype=bool)
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
                       {g: torch.from_numpy(legal[g]) if g in legal else self._all_legal[g] for g in self.mask_size},
                       shared, reward, left, asking)

    def parse_outputs(self, message: Mapping[str, Any], request: Request, what: str) -> dict[str, dict[str, Any]]:
        """The ``action`` and ``log_prob`` every agent of an uploaded step reports: group -> ``{action [1, A, *act],
        log_prob [1, A, 1]}`` (zeros for agents not acting). Actions must fit the tree and the action mask."""
        out = {}
        for g, spec in self.groups.items():
            action = _zeros(spec.agent.action, (1, spec.capacity))
            log_prob = np.zeros((1, spec.capacity, 1), dtype=np.float32)
            # a probability, not a density, when no action leaf is a box: its log is at most 0 (float32 slack)
            most = 1e-5 if all(leaf.kind != "box" for _, leaf in iter_leaves(spec.agent.action)) else np.inf
            for name, group, slot in request.agents:
                if group != g:
                    continue
                entry = message["agents"][name]
                if "action" not in entry or "log_prob" not in entry:
                    raise ProtocolError("bad_message", f"{what}: agent {name!r}: an uploaded step needs its action and "
                                                       f"log_prob", fatal=False)
                value = parse_value(entry["action"], spec.agent.action, f"{what}: agent {name!r} action")
                _check_action(value, spec.agent.action, request.action_mask.get(g), slot, f"{what}: agent {name!r}")
                _write(action, (0, slot), value)
                lp = entry["log_prob"]
                if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not np.isfinite(lp):
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r}: log_prob must be a finite number, "
                                                          f"got {lp!r}", fatal=False)
                if lp > most:
                    raise ProtocolError("spec_violation", f"{what}: agent {name!r}: log_prob {lp!r} is above 0, the "
                                                          f"log of a probability above 1 (the action space is "
                                                          f"discrete)", fatal=False)
                log_prob[0, slot, 0] = lp
            out[g] = {ACTION: _tensors(action), LOG_PROB: torch.from_numpy(log_prob)}
        return out

    def consequences(self, message: Mapping[str, Any], what: str):
        """``rewards`` and ``left`` of an ``act`` or ``end`` as per-group tensors ``[1, A, 1]``."""
        # numpy buffers, one torch.from_numpy each at the end: cheaper than torch.zeros per entry. Without any
        # reward or departure, the shared zeros (never changed in place) serve, as constant env flags do.
        rewards, left = message.get("rewards") or {}, message.get("left") or {}
        if not isinstance(rewards, dict):
            raise ProtocolError("bad_message", f"{what}: 'rewards' must be a map agent -> number", fatal=False)
        reward = {g: np.zeros((1, s.capacity, 1), np.float32) for g, s in self.groups.items()} if rewards else None
        for name, r in rewards.items():
            g, slot = self.agent(name, f"{what}: rewards")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not np.isfinite(r):
                raise ProtocolError("spec_violation", f"{what}: reward of {name!r} must be a finite number, got {r!r}",
                                    fatal=False)
            reward[g][0, slot, 0] = float(r)
        reward = dict(self._no_reward) if reward is None else {g: torch.from_numpy(r) for g, r in reward.items()}
        if not isinstance(left, dict):
            raise ProtocolError("bad_message", f"{what}: 'left' must be a map agent -> terminated|truncated", fatal=False)
        if not left:
            return reward, dict(self._nobody_left)
        term = {g: np.zeros((1, s.capacity, 1), bool) for g, s in self.groups.items()}
        trunc = {g: np.zeros((1, s.capacity, 1), bool) for g, s in self.groups.items()}
        for name, how in left.items():
            g, slot = self.agent(name, f"{what}: left")
            if how not in ("terminated", "truncated"):
                raise ProtocolError("bad_message", f"{what}: left[{name!r}] must be 'terminated' or 'truncated', got "
                                                   f"{how!r}", fatal=False)
            (term if how == "terminated" else trunc)[g][0, slot, 0] = True
        return reward, {g: (torch.from_numpy(term[g]), torch.from_numpy(trunc[g]), torch.from_numpy(term[g] | trunc[g]))
                        for g in self.groups}

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



__all__ = ["Request", "TreeCodec", "action_maps", "action_value", "parse_value", "where_slots"]
