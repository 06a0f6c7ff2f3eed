"""The simulator side of the external-environment protocol (docs/external-protocol.md), in Python: a small
client a simulator, game or robot embeds to ask a Shoal server for actions and report rewards and episode ends.

Numpy arrays in and out; no torch. Usage loop (one episode of a two-agent simulator)::

    client = SimulatorClient("ws://127.0.0.1:8765", token, tree_document, sim_id="sim-0")
    obs = sim.reset()
    rewards = {}
    while True:
        actions = client.act("ep-1", {"agents_0": obs[0], "agents_1": obs[1]}, rewards=rewards).actions
        obs, rewards, terminated, truncated = sim.step(actions)       # {agent: reward}
        if terminated or truncated:
            client.end("ep-1", "terminated" if terminated else "truncated", rewards=rewards)
            break
    client.close()

Many episodes at once: :meth:`SimulatorClient.act_many` sends every request before reading the answers (the
server batches them into one forward pass).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from ssl import SSLCertVerificationError, SSLError
from typing import Any, Mapping, Sequence

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import connect

from adapters.external.messages import (PROTOCOL_VERSION, SERVER_TYPES, ProtocolError, decode, encode, field,
                                        from_array, to_array)


class ExternalError(RuntimeError):
    """The server answered with an ``error`` message (``code`` as in the protocol) or broke the protocol."""

    def __init__(self, code: str, message: str, fatal: bool = True, request: int | None = None,
                 episode: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.fatal, self.request, self.episode = code, fatal, request, episode
        """``request``: the ``id`` of the request refused (None: a message without one, e.g. an ``end``);
        ``episode``: the episode the error is about, when it is about one."""
        self.answers: list | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """The server's answer to one ``act`` request."""

    actions: dict[str, Any]
    """Agent name -> action (a numpy array, or a dict of them for a dict action node)."""
    version: int
    """Policy version that chose the actions."""
    episode: str
    id: int


class SimulatorClient:
    """One connection to a Shoal server (module docstring).

    Args:
        url: ``ws://host:port`` (or ``wss://`` when the server has TLS; pass ``ssl`` then).
        token: the run's token (``SHOAL_TOKEN`` of a launched simulator).
        tree: the simulator's tree document (``{"format": "shoal.tree/1", "tree": ...}``).
        sim_id: this simulator's id (the launcher's ``{sim_id}``; any short name otherwise).
        timeout_s: longest wait for any answer.
        ssl: an ``ssl.SSLContext`` for ``wss://`` servers.
    """

    def __init__(self, url: str, token: str, tree: Mapping[str, Any], sim_id: str = "sim", *, timeout_s: float = 30.0,
                 max_message_bytes: int = 1 << 20, ssl: Any = None) -> None:
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self.refused: list[ExternalError] = []
        """Refusals of messages that get no answer (an ``end``): the episode they name was ended on the server
        (cut) when it refused; they arrive while the client waits for another answer, which they do not fail."""
        try:
            self._ws = connect(url, open_timeout=timeout_s, max_size=None, compression=None, ssl=ssl,
                               ping_interval=None, proxy=None, legacy=True)
        except InvalidURI as error:
            raise ExternalError("connect", f"{url!r} is not a WebSocket address ({error}): ws://host:port, or "
                                           f"wss://host:port for a server with TLS") from None
        except InvalidHandshake as error:  # something answers there, but not a WebSocket server
            tls = "; a server with TLS is reached with wss://" if url.startswith("ws://") else ""
            raise ExternalError("connect", f"cannot connect to {url}: it did not answer as a Shoal server does "
                                           f"({error}); check the host and port{tls}") from None
        except SSLCertVerificationError as error:
            raise ExternalError("connect", f"cannot connect to {url}: the server's certificate is not trusted "
                                           f"({error.verify_message}); pass an ssl context that trusts it") from None
        except SSLError as error:
            raise ExternalError("connect", f"cannot connect to {url}: TLS failed ({error}); a server without "
                                           f"TLS is reached with ws://, not wss://") from None
        self._max = max_message_bytes
        self._ws.send(encode({"type": "hello", "protocol": PROTOCOL_VERSION, "token": token, "sim_id": sim_id,
                              "tree": dict(tree)}))
        welcome = self._receive()
        if welcome["type"] != "welcome":
            raise ExternalError("bad_message", f"expected welcome, got {welcome['type']!r}")
        self.welcome = welcome
        self._max = int(welcome.get("max_message_bytes", max_message_bytes))
        self._early: dict[int, Answer] = {}

    # -- requests --------------------------------------------------------------------------------------------
    def act(self, episode: str, agents: Mapping[str, Any], *, rewards: Mapping[str, float] | None = None,
            left: Mapping[str, str] | None = None, shared: Any = None,
            action_masks: Mapping[str, np.ndarray] | None = None) -> Answer:
        """Actions for the ``agents`` of ``episode`` that need a decision (agent -> observation).

        Args:
            rewards: agent -> reward received since its previous decision in this episode.
            left: agent -> ``"terminated"`` / ``"truncated"``: agents that left since the previous request.
            shared: the shared observation, when the tree declares one.
            action_masks: agent -> bool array of legal actions.
        """
        return self.act_many([dict(episode=episode, agents=agents, rewards=rewards, left=left, shared=shared,
                                   action_masks=action_masks)])[0]

    def act_many(self, requests: Sequence[Mapping[str, Any]]) -> list[Answer]:
        """Sends every request (keyword arguments of :meth:`act`, for different episodes), then waits for all
        the answers; returned in request order. A refused request (a non-fatal error: that episode ended on the
        server) raises its :class:`ExternalError` after every answer arrived; ``error.answers`` holds them all."""
        ids = [self._send_act(**r) for r in requests]
        answers = []
        for i in ids:  # every answer is read, so a refused request does not strand the others
            try:
                answers.append(self._answer(i))
            except ExternalError as error:
                if error.fatal:
                    raise
                answers.append(error)
        refused = [a for a in answers if isinstance(a, ExternalError)]
        if refused:
            refused[0].answers = answers  # the others' answers (an ExternalError where refused)
            raise refused[0]
        return answers

    def end(self, episode: str, outcome: str, *, rewards: Mapping[str, float] | None = None,
            observations: Mapping[str, Any] | None = None) -> None:
        """Ends ``episode`` (``outcome``: ``"terminated"`` or ``"truncated"``), with its last rewards and, for a
        truncation, the agents' final observations."""
        message: dict[str, Any] = {"type": "end", "episode": episode, "outcome": outcome}
        if rewards:
            message["rewards"] = {k: float(v) for k, v in rewards.items()}
        if observations:
            message["observations"] = {k: _tree(v) for k, v in observations.items()}
        self._send(message)

    def get_policy(self) -> dict[str, dict[str, Any]]:
        """Every group's ``{"policy", "version", "config", "tensors": {name: array}}``: what a simulator needs to
        act with its own copy (:class:`adapters.external.local_policy.LocalPolicy`)."""
        request = next(self._ids)
        self._send({"type": "get_policy", "id": request})
        groups = self._reply(request, "policy")["groups"]
        for entry in groups.values():
            entry["tensors"] = {k: to_array(v, f"policy tensor {k}") for k, v in entry["tensors"].items()}
        return groups

    def upload(self, episode: str, versions: Mapping[str, int], steps: Sequence[Mapping[str, Any]], *,
               end: Mapping[str, Any] | None = None) -> int:
        """Sends steps this simulator acted itself (a ``trajectory``; each step an ``act``'s fields plus every
        agent's ``action`` and ``log_prob``), and the episode's ``end`` if it ended; returns the steps accepted."""
        request = next(self._ids)
        message: dict[str, Any] = {"type": "trajectory", "id": request, "episode": episode, "versions": dict(versions),
                                   "steps": list(steps)}
        if end is not None:
            message["end"] = dict(end)
        self._send(message)
        return int(self._reply(request, "accepted")["steps"])

    def _reply(self, request: int, kind: str) -> dict[str, Any]:
        while True:
            message = self._receive()
            if message["type"] == kind and message.get("id") == request:
                return message
            self._stash(message)

    def ping(self) -> None:
        """A keep-alive message; waits for its pong."""
        self._send({"type": "ping", "t": 0})
        while True:
            message = self._receive()
            if message["type"] == "pong":
                return
            self._stash(message)

    def close(self) -> None:
        """Says goodbye and closes (the server truncates episodes left open)."""
        try:
            self._send({"type": "bye"})
        except Exception:  # noqa: BLE001 - the server may be gone already
            pass
        self._ws.close()

    def __enter__(self) -> SimulatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------------------------
    def _send_act(self, episode: str, agents: Mapping[str, Any], rewards=None, left=None, shared=None,
                  action_masks=None) -> int:
        request = next(self._ids)
        entries = {}
        for name, obs in agents.items():
            entry = {"observation": _tree(obs)}
            if action_masks and name in action_masks:
                entry["action_mask"] = from_array(np.asarray(action_masks[name], dtype=bool))
            entries[name] = entry
        message: dict[str, Any] = {"type": "act", "id": request, "episode": episode, "agents": entries}
        if rewards:
            message["rewards"] = {k: float(v) for k, v in rewards.items()}
        if left:
            message["left"] = dict(left)
        if shared is not None:
            message["shared"] = _tree(shared)
        self._send(message)
        return request

    def _answer(self, request: int) -> Answer:
        while request not in self._early:
            try:
                self._stash(self._receive())
            except ExternalError as error:
                if error.fatal or error.request is None or error.request == request:
                    raise
                self._early[error.request] = error  # another pending request's refusal: raised when asked for
        answer = self._early.pop(request)
        if isinstance(answer, ExternalError):
            raise answer
        return answer

    def _stash(self, message: dict[str, Any]) -> None:
        if message["type"] == "actions":
            actions = {k: _untree(v, f"action of {k}") for k, v in field(message, "actions", dict).items()}
            answer = Answer(actions, int(field(message, "version", int)), str(message.get("episode")),
                            int(field(message, "id", int)))
            self._early[answer.id] = answer
        elif message["type"] == "ping":
            self._send({"type": "pong", "t": message.get("t", 0)})

    def _send(self, message: Mapping[str, Any]) -> None:
        frame = encode(message)
        if len(frame) > self._max:  # the server would close the connection (1009) without a word on what
            raise ExternalError("too_large", f"this {message.get('type')!r} message ({len(frame)} bytes) is over "
                                             f"the server's max_message_bytes ({self._max}, told in its welcome); "
                                             f"send fewer agents per request, or raise --external.max-message-bytes")
        try:
            self._ws.send(frame)
        except ConnectionClosed as closed:
            raise ExternalError("closed", f"the server closed the connection ({closed})") from None

    def _receive(self) -> dict[str, Any]:
        while True:
            try:
                frame = self._ws.recv(timeout=self.timeout_s)
                message = decode(frame, max_bytes=1 << 62, allowed=SERVER_TYPES)
            except TimeoutError:
                raise ExternalError("timeout", f"no answer from the server within {self.timeout_s} s") from None
            except ConnectionClosed as closed:
                raise ExternalError("closed", f"the server closed the connection ({closed})") from None
            except ProtocolError as error:
                raise ExternalError(error.code, str(error)) from None
            if message["type"] != "error":
                return message
            episode = message.get("episode")
            error = ExternalError(str(message.get("code")), str(message.get("message")), bool(message.get("fatal")),
                                  request=message.get("id"), episode=episode if isinstance(episode, str) else None)
            if error.fatal or error.request is not None or error.episode is None:
                raise error
            self.refused.append(error)  # an earlier end's refusal (it has no id): not the request waited for


def _tree(value: Any) -> Any:
    """An observation as array maps (dicts stay dicts): what :func:`encode` makes of numpy arrays, made here so
    that MessagePack packs plain maps without calling back for each array."""
    if type(value) is np.ndarray:
        return from_array(value)
    if isinstance(value, Mapping):
        return {k: _tree(v) for k, v in value.items()}
    return from_array(np.asarray(value))


def _untree(value: Any, what: str) -> Any:
    if isinstance(value, dict) and "dtype" not in value:
        return {k: _untree(v, f"{what}/{k}") for k, v in value.items()}
    return to_array(value, what)


__all__ = ["Answer", "ExternalError", "SimulatorClient"]
