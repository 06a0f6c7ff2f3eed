"""The conformance kit's checks of single messages (docs/external-protocol.md): a ``hello`` and its tree, and the
fields of ``act`` and ``end`` against that tree and the episode's state so far.

Values (observations, shared and final observations) are judged by the server's own rule,
:func:`adapters.external.codec.parse_value`, and the tree is parsed and served by the server's
:class:`~adapters.external.codec.TreeCodec`. What the kit adds are the page's rules that the server does not
enforce (``left`` names an agent of the episode, an agent that left does not come back) and findings that name
every fault of a message, not only its first. Each finding is a ``(key, text)`` pair: the key groups repeats of
one fault, the text names it (the caller prefixes the message it came from).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapters.external.codec import TreeCodec, parse_value
from adapters.external.conformance_report import short
from adapters.external.messages import MAX_NAME, PROTOCOL_VERSION, ProtocolError, spec_hash, to_array
from core.specs import AgentNode, Leaf, Node, from_json, to_json

OUTCOMES = ("terminated", "truncated")
Problem = tuple[str, str]
_HELLO = {"type", "protocol", "token", "sim_id", "tree", "spec_hash"}
_ACT = {"type", "id", "episode", "agents", "rewards", "left", "shared"}
_END = {"type", "episode", "outcome", "rewards", "observations"}


@dataclass(slots=True)
class KitTree:
    """The simulator's tree, as the kit uses it."""

    document: dict[str, Any]
    """The tree document (wrapped when the hello sent a bare tree)."""
    hash: str
    """The spec hash of the tree's canonical form: what ``welcome`` carries."""
    codec: TreeCodec
    """The server's view of the tree (groups, agents, the shared observation)."""
    agents: dict[str, AgentNode]
    """Agent name -> its spaces."""

    def agent_list(self) -> str:
        names = list(self.agents)
        return ", ".join(names) if len(names) <= 8 else f"{', '.join(names[:6])}, ... ({len(names)} agents)"


@dataclass(slots=True)
class EpisodeState:
    """One episode of the connection, as far as the kit has seen it."""

    seen: set[str] = field(default_factory=set)
    """Agents that asked for a decision."""
    gone: set[str] = field(default_factory=set)
    """Agents that left through ``left``."""
    pending: int | None = None
    """The id of its unanswered ``act``."""
    acts: int = 0
    last: dict[str, int] = field(default_factory=dict)
    """Agent -> the episode's act (1, 2, ...) with its latest decision."""
    at: int = 0
    """The connection's act count at the episode's latest act."""


SILENT_ACTS = 8
"""An agent with no decision in this many of its episode's last acts (at least; 4 per agent seen) that never left
through ``left`` is a warning at the episode's end: the server cannot complete its last step until then."""
ABANDONED_ACTS = 64
"""A running episode with no act while the connection sent this many is abandoned (it never ends): a failure."""


def silent_agents(episode: EpisodeState) -> list[str]:
    """The agents of ``episode`` that stopped asking for decisions without leaving (:data:`SILENT_ACTS`)."""
    quiet = max(SILENT_ACTS, 4 * len(episode.seen))
    return sorted(a for a, k in episode.last.items() if a not in episode.gone and episode.acts - k >= quiet)


def abandoned(episodes: dict[str, EpisodeState], ended: dict[str, str], acts: int) -> list[str]:
    """Running episodes, no act unanswered, whose latest act is more than :data:`ABANDONED_ACTS` of the
    connection's ``acts`` ago, oldest first."""
    idle = [(e.at, name) for name, e in episodes.items()
            if name not in ended and e.pending is None and acts - e.at > ABANDONED_ACTS]
    return [name for _, name in sorted(idle)]


def abandoned_note(idle: list[str]) -> str:
    """What :func:`abandoned`'s list (not empty) means, for a finding."""
    return (f"{len(idle)} episode(s) never ended: no act over the connection's last {ABANDONED_ACTS} acts (the "
            f"first: {idle[0]!r}), and no 'end'")


@dataclass(slots=True)
class Checked:
    """What one message showed."""

    failures: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    covered: set[str] = field(default_factory=set)
    """Coverage items the message exercised (``masks``, ``rewards``, an outcome, ``final_observations``)."""
    left: set[str] = field(default_factory=set)
    """Agents that leave with this ``act``."""
    fatal: tuple[str, str] | None = None
    """The code and text of the fatal error a server answers with (a ``hello`` it refuses; a malformed array,
    which the server's parser refuses as a fatal ``bad_message``)."""

    def fail(self, key: str, error: str | ProtocolError) -> None:
        """Records a failure; a fatal :class:`ProtocolError` (the server's own parser's) also sets :attr:`fatal`."""
        self.failures.append((key, str(error)))
        if isinstance(error, ProtocolError) and error.fatal and self.fatal is None:
            self.fatal = (error.code, str(error))


# -- the tree -------------------------------------------------------------------------------------------------
def parse_tree(document: Any) -> tuple[KitTree | None, list[str]]:
    """The tree of a hello's ``tree`` and its problems; None (the reason first) when the kit cannot use it."""
    if not isinstance(document, dict):
        return None, [f"'tree' must be a map (the tree document), got a {type(document).__name__}"]
    problems = []
    if "format" not in document and "tree" not in document:
        problems.append("'tree' is a bare tree; send the document {\"format\": \"shoal.tree/1\", \"tree\": ...} (the "
                        "kit goes on with the bare tree wrapped)")
        document = {"format": "shoal.tree/1", "tree": document}
    try:
        text = json.dumps(document)
    except (TypeError, ValueError) as error:
        return None, [f"the tree document is not plain JSON data ({error})", *problems]
    try:
        tree = from_json(text)
    except Exception as error:  # noqa: BLE001 - TreeError, KeyError, TypeError ... all mean "does not parse"
        hint = " (core.specs spells that leaf kind 'binary')" if "multi_binary" in text else ""
        return None, [f"the tree does not parse: {type(error).__name__}: {error}{hint}", *problems]
    try:
        codec = TreeCodec(tree)
    except ValueError as error:  # a shared observation below the root population, two groups of one name
        return None, [f"the server does not serve this tree: {error}", *problems]
    agents = {name: group.agent for group in codec.groups.values() for name in group.agent_names}  # unique: codec
    too_long = [f"agent name {n!r} is longer than {MAX_NAME} characters" for n in agents if len(n) > MAX_NAME]
    if too_long:
        return None, [*too_long, *problems]
    canonical = spec_hash(json.loads(to_json(tree)))  # what the server's welcome carries
    return KitTree(document, canonical, codec, agents), problems


def non_finite_floats(value: Any, path: str = "tree") -> list[str]:
    """Paths of the float infinities and NaNs in a JSON-like document."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite_floats(v, f"{path}/{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in non_finite_floats(v, f"{path}/{i}")]
    return []


# -- values ---------------------------------------------------------------------------------------------------
def value_problem(value: Any, node: Node, what: str) -> str | None:
    """Why ``value`` does not fit ``node`` by the server's rule (:func:`~adapters.external.codec.parse_value`)."""
    problem = value_error(value, node, what)
    return None if problem is None else str(problem)


def value_error(value: Any, node: Node, what: str) -> str | ProtocolError | None:
    """:func:`value_problem` as the server's own error where it raises one (whose ``fatal`` it acts on)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # a plain number out of range is a finding, not a warning
            parse_value(value, node, what)
    except ProtocolError as error:
        return error
    except OverflowError:  # a MessagePack integer beyond int64
        return f"{what}: {short(value)} does not fit any protocol dtype"
    return None


def mask_problem(value: Any, action: Node, what: str) -> str | ProtocolError | None:
    """Why ``value`` is not a usable action mask of ``action`` (as :func:`value_error`), or None."""
    if not (isinstance(action, Leaf) and action.kind == "discrete"):
        return f"{what}: an action_mask, but the agent's action is not a discrete leaf"
    try:
        mask = to_array(value, what)
    except ProtocolError as error:
        return error
    if mask.dtype != np.bool_:
        return f"{what}: dtype {mask.dtype.name}; an action mask is a bool array"
    if mask.shape != (action.n,):
        return f"{what}: shape {list(mask.shape)}; the action has n={action.n} choices, so the shape is [{action.n}]"
    if not mask.any():
        return f"{what}: no legal action (every element False)"
    return None


# -- messages -------------------------------------------------------------------------------------------------
def check_hello(message: dict[str, Any], *, token: str, sim_id: str | None) -> tuple[Checked, KitTree | None]:
    """A connection's first message; ``sim_id`` is the launch's ``{sim_id}`` (None: not in the command)."""
    out = Checked()
    if message["type"] != "hello":
        out.failures.append(("hello.first", "the first message must be a hello"))
        out.fatal = ("bad_message", "the first message must be a hello")
        return out, None
    protocol = message.get("protocol")
    if protocol != PROTOCOL_VERSION or isinstance(protocol, bool):
        out.failures.append(("hello.protocol", f"'protocol' is {protocol!r}; the kit speaks version "
                                               f"{PROTOCOL_VERSION}"))
        out.fatal = ("protocol_version", f"this server speaks protocol {PROTOCOL_VERSION}")
        return out, None
    sent = message.get("token")
    if sent != token:
        shown = "missing" if sent is None else ("a string of the wrong value" if isinstance(sent, str)
                                                else f"a {type(sent).__name__}")
        out.failures.append(("hello.token", f"'token' is {shown}; expected the token handed in {{token}} and "
                                            f"SHOAL_TOKEN (the kit goes on as if it were right)"))
    name = message.get("sim_id")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        out.failures.append(("hello.sim_id", f"'sim_id' must be a string of 1-{MAX_NAME} characters, got "
                                             f"{short(name)}"))
        out.fatal = ("bad_message", "hello: 'sim_id' must be a short string")  # as the server refuses it
        return out, None
    elif sim_id is not None and name != sim_id:
        out.warnings.append(("hello.sim_id", f"sim_id {name!r} is not the {{sim_id}} it was launched with "
                                             f"({sim_id!r})"))
    if "tree" not in message:
        out.failures.append(("hello.tree", "no 'tree'"))
        out.fatal = ("bad_message", "hello without its 'tree'")
        return out, None
    tree, problems = parse_tree(message["tree"])
    out.failures += [("hello.tree", problem) for problem in problems]
    if tree is None:
        out.fatal = ("spec_mismatch" if isinstance(message["tree"], dict) else "bad_message", problems[0])
        return out, None
    for path in non_finite_floats(tree.document):
        out.failures.append(("hello.inf", f"{path} is a float infinity or NaN; the doc writes infinite bounds as the "
                                          f"strings 'inf'/'-inf' (the spec hash needs plain JSON)"))
    if "spec_hash" in message:
        claimed, own = message["spec_hash"], spec_hash(message["tree"])
        if claimed != own:
            out.failures.append(("hello.spec_hash", f"spec_hash {short(claimed)} is not the SHA-256 of the tree "
                                                    f"document it sent ({own}); see 'The tree' in the doc"))
            out.fatal = ("spec_mismatch", "hello: spec_hash is not the hash of the tree sent")  # as the server's
            return out, None
    else:
        out.notes.append("hello carries no spec_hash (optional): the hash was not checked")
    out.warnings += [(f"hello.extra.{k}", f"unknown field {k!r} (ignored)") for k in sorted(set(message) - _HELLO)]
    return out, tree


def check_act(message: dict[str, Any], tree: KitTree, episode: EpisodeState) -> Checked:
    """An ``act``'s agents, rewards, ``left`` and ``shared`` (its id and episode id are the session's to check)."""
    out = Checked()
    agents = message.get("agents")
    if not isinstance(agents, dict) or not agents:
        out.failures.append(("act.agents", f"'agents' must be a non-empty map of agent name -> entry, got "
                                           f"{short(agents)}"))
        return out
    left = message.get("left")
    if left is not None and not isinstance(left, dict):
        out.failures.append(("act.left", f"'left' must be a map agent -> 'terminated'/'truncated', got {short(left)}"))
    problems, out.left = membership(agents, left if isinstance(left, dict) else {}, tree, episode, "act")
    out.failures += problems
    for agent, entry in agents.items():
        if agent not in tree.agents:
            out.failures.append(("act.unknown_agent", f"agent {agent!r} is not in the tree (agents: "
                                                      f"{tree.agent_list()})"))
            continue
        if not isinstance(entry, dict) or "observation" not in entry:
            out.failures.append(("act.entry", f"agents[{agent!r}] must be a map with an 'observation', got "
                                              f"{short(entry)}"))
            continue
        spaces = tree.agents[agent]
        problem = value_error(entry["observation"], spaces.observation, f"observation of {agent}")
        if problem:
            out.fail("act.observation", problem)
        if "action_mask" in entry:
            out.covered.add("masks")
            problem = mask_problem(entry["action_mask"], spaces.action, f"action_mask of {agent}")
            if problem:
                out.fail("act.action_mask", problem)
        for key in sorted(set(entry) - {"observation", "action_mask"}):
            out.failures.append(("act.entry_extra", f"agents[{agent!r}] has a field {key!r}; an entry is "
                                                    f"{{observation, action_mask?}}"))
    _check_rewards(message, tree, episode, "act", out)
    _check_shared(message, tree, out)
    out.warnings += [(f"act.extra.{k}", f"unknown field {k!r} (ignored)") for k in sorted(set(message) - _ACT)]
    return out


def membership(agents: dict, left: dict, tree: KitTree, episode: EpisodeState, kind: str
               ) -> tuple[list[Problem], set[str]]:
    """The join and leave rules of one ``act`` (or uploaded step, ``kind`` names it) against what the episode
    showed before: ``(problems, the agents that left validly)``. An agent leaves once, after it joined, and does
    not come back."""
    problems, gone = [], set()
    for agent, how in left.items():
        if how not in OUTCOMES:
            problems.append((f"{kind}.left_value", f"left[{agent!r}] is {short(how)}; it must be 'terminated' or "
                                                   f"'truncated'"))
        if agent not in tree.agents:
            problems.append((f"{kind}.left_unknown", f"left names {agent!r}, not an agent of the tree"))
        elif agent in episode.gone:
            problems.append((f"{kind}.left_twice", f"agent {agent!r} left this episode a second time"))
        elif agent not in episode.seen:
            problems.append((f"{kind}.left_unseen", f"agent {agent!r} leaves an episode it never joined"))
        else:
            gone.add(agent)
    for agent in agents:
        if agent in tree.agents and (agent in episode.gone or agent in gone):
            problems.append((f"{kind}.came_back", f"agent {agent!r} left this episode and comes back (an agent "
                                                  f"that left does not come back in that episode)"))
    return problems, gone


def check_end(message: dict[str, Any], tree: KitTree, episode: EpisodeState) -> Checked:
    """An ``end`` of a running episode: its outcome, rewards and final observations."""
    out = Checked()
    if episode.pending is not None:
        out.failures.append(("end.outstanding", f"end while act {episode.pending} of the episode is unanswered"))
    outcome = message.get("outcome")
    if "outcome" not in message:
        out.failures.append(("end.outcome", "'outcome' is missing; it must be 'terminated' or 'truncated'"))
    elif outcome not in OUTCOMES:
        out.failures.append(("end.outcome", f"'outcome' is {short(outcome)}; it must be 'terminated' or 'truncated'"))
    else:
        out.covered.add(outcome)
    _check_rewards(message, tree, episode, "end", out)
    observations = message.get("observations")
    if observations is not None and not isinstance(observations, dict):
        out.failures.append(("end.observations", f"'observations' must be a map agent -> observation, got "
                                                 f"{short(observations)}"))
    elif observations:
        if outcome == "truncated":
            out.covered.add("final_observations")
        for agent, value in observations.items():
            if agent not in tree.agents:
                out.failures.append(("end.observation_agent", f"a final observation for {agent!r}, not an agent of "
                                                              f"the tree"))
                continue
            problem = value_error(value, tree.agents[agent].observation, f"final observation of {agent}")
            if problem:
                out.fail("end.observation", problem)
    out.warnings += [(f"end.extra.{k}", f"unknown field {k!r} (ignored)") for k in sorted(set(message) - _END)]
    if silent := silent_agents(episode):
        out.warnings.append(("agent.silent", f"{', '.join(map(repr, silent[:4]))} had no decision in the episode's "
                                             f"last {max(SILENT_ACTS, 4 * len(episode.seen))} acts or more and never "
                                             f"left through 'left': the server could not complete their last step "
                                             f"until this end (it bootstraps meanwhile, env/external_approx_"
                                             f"bootstraps); send 'left' when an agent is done"))
    return out


def _check_rewards(message: dict[str, Any], tree: KitTree, episode: EpisodeState, kind: str, out: Checked) -> None:
    rewards = message.get("rewards")
    if rewards is None:
        return
    if not isinstance(rewards, dict):
        out.failures.append((f"{kind}.rewards", f"'rewards' must be a map agent -> number, got {short(rewards)}"))
        return
    for agent, reward in rewards.items():
        if agent not in tree.agents:
            out.failures.append((f"{kind}.reward_agent", f"a reward for {agent!r}, not an agent of the tree"))
        elif agent not in episode.seen:
            out.warnings.append((f"{kind}.reward_unseen", f"a reward for {agent!r}, which has not had a decision in "
                                                          f"this episode (nothing to credit it to)"))
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            out.failures.append((f"{kind}.reward_type", f"rewards[{agent!r}] must be a number, got {short(reward)}"))
        elif not math.isfinite(reward):
            out.failures.append((f"{kind}.reward_finite", f"rewards[{agent!r}] is {reward}"))
        else:
            out.covered.add("rewards")


def _check_shared(message: dict[str, Any], tree: KitTree, out: Checked) -> None:
    node = tree.codec.shared
    if node is None:
        if "shared" in message:
            out.failures.append(("act.shared", "'shared' sent, but the tree declares no shared observation"))
    elif "shared" not in message:
        out.failures.append(("act.shared", "no 'shared', but the tree declares a shared observation"))
    else:
        problem = value_error(message["shared"], node, "shared")
        if problem:
            out.fail("act.shared", problem)


__all__ = ["OUTCOMES", "Checked", "EpisodeState", "KitTree", "check_act", "check_end", "check_hello",
           "mask_problem", "non_finite_floats", "parse_tree", "value_error", "value_problem"]
