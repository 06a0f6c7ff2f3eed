"""The external-environment server (seed 002): simulators and robots connect over WebSocket, speak the protocol
of docs/external-protocol.md, get their actions from the batched inference service, and every episode they
run becomes fragments for the learners (:mod:`orchestration.external_episodes`).

One thread per connection (``websockets.sync``). A connection's thread reads every frame already queued,
sends all of its ``act`` requests to the inference service at once (one batch serves many connections), then
answers them; a lone request is served at once when the service is idle (``InferenceService.serve_alone``).
Each answer leaves before its step is recorded. Usage::

    server = ExternalServer(config.external).start()       # binds; simulators may connect now
    tree = server.wait_for_tree(timeout_s)                  # the first simulator's tree (or config.tree)
    server.attach(service, lanes)                           # acting and recording begin
    ...
    server.close()                                          # open episodes end truncated, counted

Security (docs/external-protocol.md): loopback unless told otherwise, TLS or an explicit insecure flag off
loopback, a token compared in constant time, bounded frames, episodes and connections, and every fault is
answered with an ``error`` message that names it while the other connections go on.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import ssl
import sys
import threading
import time
from typing import Any, Mapping

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from adapters.external.messages import (MAX_NAME, PROTOCOL_VERSION, ProtocolError, decode, encode, field,
                                        name_field, spec_hash, tree_difference)
from core.layout import ACTION, LOG_PROB
from core.specs import Tree, from_json, to_json
from orchestration.addresses import is_loopback, server_url
from orchestration.config import ExternalConfig
from adapters.external.codec import TreeCodec, action_maps
from orchestration.external_episodes import Episode, Lanes
from orchestration.external_endings import ConnectionEndings
from orchestration.external_uploads import LocalPolicyHandlers

_QUIET = logging.getLogger("shoal.external_server.websockets")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False
_WELCOMED_KEPT = 4096  # sim ids remembered in ExternalServer.welcomed
_DRAIN = 64  # frames a connection reads before it answers them (they share inference batches)


class ExternalServer(LocalPolicyHandlers, ConnectionEndings):
    """Accepts simulators (module docstring).

    Args:
        config: address, token, limits, TLS.
        tree: the tree every simulator must send; None: the first simulator's is adopted.
        log: where the start banner and warnings go (None: ``sys.stderr``).
    """

    def __init__(self, config: ExternalConfig, tree: Tree | None = None, *, log=None) -> None:
        self.config = config
        if not is_loopback(config.host) and not config.tls_cert and not config.insecure:
            raise ValueError(f"--external.host {config.host!r} is not a loopback address: give --external.tls-cert and "
                             f"--external.tls-key (wss://), or pass --external.insecure to serve it unencrypted")
        self.token = config.token or secrets.token_hex(24)  # hex: a leading '-' would read as an option in a command
        self._log = sys.stderr if log is None else log  # resolved now: a default would bind at import
        self._tree_doc, self._hash, self.tree = None, None, None  # the run's tree: given, or the first simulator's
        self.tree_ready = threading.Event()
        if tree is not None:
            self._adopt(tree)
        self._ready = threading.Event()
        self._service = self._lanes = self._codec = None
        self._lock = threading.Lock()
        self._connections: dict[int, dict] = {}
        self.connected: set[str] = set()
        """sim ids of the simulators connected now."""
        self.welcomed: dict[str, None] = {}
        """sim ids that completed a hello, in order, the newest :data:`_WELCOMED_KEPT` (a launched simulator that
        connected and crashed between two of the launcher's looks is told apart from one that never connected)."""
        self.counters = dict(connections=0, refused=0, protocol_errors=0, requests=0, disconnects=0, uploaded_steps=0,
                             idle_closed=0)
        self._told: dict[str, int] = {}  # refusals printed on the log, per error code
        self.errors, self.refused_sims = {}, {}  # code -> times answered; claimed sim id -> its refusal's code
        self._server, self._thread = None, None
        self._closed = self._ending = False

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> ExternalServer:
        """Binds and serves in a background thread."""
        c, context = self.config, None
        if c.tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.num_tickets = 0  # no TLS 1.3 tickets: docs/external-protocol.md, Security
            try:
                context.load_cert_chain(c.tls_cert, c.tls_key)
            except (OSError, ssl.SSLError) as error:  # missing or unreadable files, not a certificate and its key
                raise ValueError(f"--external.tls-cert {c.tls_cert!r} and --external.tls-key {c.tls_key!r}: "
                                 f"cannot load them ({error})") from None
        elif not is_loopback(c.host):
            print(f"shoal: WARNING: the external-environment server on {c.host} is not encrypted "
                  f"(--external.insecure): anyone on the network can read the token and the data", file=self._log)
        try:
            self._server = serve(self._handle, c.host, c.port, ssl=context, compression=None,
                                 max_size=c.max_message_bytes, ping_interval=c.heartbeat_s, ping_timeout=c.heartbeat_s,
                                 max_queue=16, open_timeout=c.heartbeat_s, close_timeout=2, server_header=None,
                                 logger=_QUIET)  # its tracebacks of a connection's end: the server says it itself
        except OSError as error:  # the port is taken, the host is not this machine's or does not resolve
            raise ValueError(f"cannot serve on --external.host {c.host!r}, --external.port {c.port}: "
                             f"{error.strerror or error} (port 0: any free port; the host: this machine's)") from None
        self._port = self._server.socket.getsockname()[1]  # kept: messages name it after the socket closed
        self._thread = threading.Thread(target=self._server.serve_forever, name="shoal-external-server", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._port

    @property
    def url(self) -> str:
        return server_url(self.config.host, self.port, bool(self.config.tls_cert))

    def wait_for_tree(self, timeout_s: float) -> Tree:
        """The run's tree: given, or the first simulator's (waits up to ``timeout_s``)."""
        if not self.tree_ready.wait(timeout_s):
            raise TimeoutError(f"no simulator connected to {self.url} within {timeout_s} s, so the environment's "
                               f"tree is unknown (start simulators, or give external.tree)")
        return self.tree

    def attach(self, service, lanes: Lanes, policy_config: Mapping[str, Any] | None = None) -> None:
        """Starts acting with ``service`` (an :class:`orchestration.inference.InferenceService`) and recording
        into ``lanes``; requests that arrived before wait for this. ``policy_config`` (the fields of the run's
        :class:`core.policies.PolicyConfig`) goes with the weights to simulators that act themselves."""
        self._service, self._lanes, self._codec = service, lanes, lanes.codec
        self._policy_config = dict(policy_config or {})
        self._ready.set()

    def close(self) -> None:
        """Stops accepting, closes every connection (their episodes end truncated); idempotent."""
        if self._closed:
            return
        self._closed = self._ending = True
        self._ready.set()  # release handlers waiting to act: they see the server closing
        if self._server is not None:
            self._server.shutdown()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            conns = [c["ws"] for c in self._connections.values()]
        for ws in conns:
            ws.close()
        deadline = time.monotonic() + 5
        while self._connections and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- the tree ----------------------------------------------------------------------------------------------
    def _adopt(self, tree: Tree) -> None:
        TreeCodec(tree)  # a tree the protocol serves
        self._tree_doc = json.loads(to_json(tree))
        self._hash = spec_hash(self._tree_doc)
        self.tree = tree
        self.tree_ready.set()

    def _check_tree(self, document: Any) -> None:
        """Adopts the first simulator's tree, or checks that ``document`` is the run's tree (compared in the
        canonical form, so key order and number formatting do not matter)."""
        if not isinstance(document, dict):
            raise ProtocolError("bad_message", "hello field 'tree' must be a tree document (a map)")
        try:
            tree = from_json(json.dumps(document if "format" in document else {"format": "shoal.tree/1",
                                                                                  "tree": document}))
            TreeCodec(tree)
        except (ValueError, KeyError, TypeError) as error:
            raise ProtocolError("spec_mismatch", f"hello: the tree does not parse: {error}") from None
        with self._lock:
            if self._tree_doc is None:
                self._adopt(tree)
                print(f"shoal: external environment tree adopted from the first simulator (spec hash "
                      f"{self._hash[:12]})", file=self._log)
                return
        mine = json.loads(to_json(tree))
        got = spec_hash(mine)
        if got != self._hash:
            raise ProtocolError("spec_mismatch", f"hello: this simulator's tree (spec hash {got[:12]}) differs from "
                                                 f"the run's (spec hash {self._hash[:12]}): "
                                                 f"{tree_difference(mine, self._tree_doc)}")

    # -- one connection ----------------------------------------------------------------------------------------
    def _handle(self, ws: ServerConnection) -> None:
        key = id(ws)
        episodes: dict[str, Episode] = {}
        state: dict[str, Any] = {"ws": ws, "sim": None}
        closing = (1000, "")  # the close frame's code and reason
        try:
            with self._lock:
                self.counters["connections"] += 1
                self._connections[key] = state
                busy = len(self._connections) > self.config.max_simulators
            if busy:
                raise ProtocolError("busy", f"the server serves at most {self.config.max_simulators} simulators")
            self._hello(ws, state)
            self._serve(ws, episodes)
        except ProtocolError as error:
            self._refuse(ws, error, state)
        except ConnectionClosed as closed:  # 1009: websockets refused an oversized frame unread
            if closed.sent is not None and closed.sent.code == 1009:
                limit = f"max_message_bytes={self.config.max_message_bytes}"
                self._refuse(ws, ProtocolError("too_large", f"a frame over {limit}"), state)
            else:  # a simulator that died, stopped answering pings, or left mid-episode: named on the log
                self._lost(state, closed, len(episodes))
        except TimeoutError:  # silent past the hello deadline or idle_timeout_s: told in the close frame and the log
            closing = (1008, self._idle(state))
        except OSError:
            pass
        except Exception as error:  # noqa: BLE001 - one connection's bug never takes the server down
            print(f"shoal: external connection of {state['sim'] or 'an unnamed simulator'} ended by an internal "
                  f"error: {type(error).__name__}: {error}", file=self._log)
            self._refuse(ws, ProtocolError("internal", f"{type(error).__name__}: {error}"), state, tell=False)
        finally:
            for episode in episodes.values():
                episode.cut()
            with self._lock:
                self._connections.pop(key, None)
                if state["sim"] is not None:
                    self.connected.discard(state["sim"])
                self.counters["disconnects"] += 1
            ws.close(*closing)

    def _hello(self, ws: ServerConnection, state: dict) -> None:
        hello = decode(ws.recv(timeout=self.config.heartbeat_s), max_bytes=self.config.max_message_bytes)
        if hello["type"] != "hello":
            raise ProtocolError("bad_message", f"the first message must be 'hello', got {hello['type']!r}")
        claimed = hello.get("sim_id")  # before the version and the token: a name for the log only, bounded
        state["hello_sim"] = claimed if isinstance(claimed, str) and 1 <= len(claimed) <= MAX_NAME else None
        if field(hello, "protocol", int) != PROTOCOL_VERSION:
            raise ProtocolError("protocol_version", f"protocol {hello['protocol']} is not served; this server speaks "
                                                    f"version {PROTOCOL_VERSION}")
        token = field(hello, "token", str)
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise ProtocolError("bad_token", "the token does not match this run's")
        sim = name_field(hello, "sim_id")
        self._check_tree(hello.get("tree"))
        claimed = field(hello, "spec_hash", str, optional=True)
        if claimed is not None and claimed != spec_hash(hello["tree"]):
            raise ProtocolError("spec_mismatch", f"hello: spec_hash {claimed[:12]} is not the hash of the tree sent "
                                                 f"({spec_hash(hello['tree'])[:12]})")
        if not self._ready.wait(self.config.start_timeout_s) or self._closed:
            raise ProtocolError("busy", "the server is not ready to act (closing or still building the policies)")
        state["sim"] = sim
        with self._lock:
            self.connected.add(sim)
            self.welcomed[sim] = None
            if len(self.welcomed) > _WELCOMED_KEPT:
                del self.welcomed[next(iter(self.welcomed))]
        ws.send(encode({"type": "welcome", "protocol": PROTOCOL_VERSION, "session": secrets.token_hex(8),
                        "spec_hash": self._hash, "heartbeat_s": self.config.heartbeat_s,
                        "idle_timeout_s": self.config.idle_timeout_s, "max_message_bytes": self.config.max_message_bytes,
                        "max_episodes": self.config.max_episodes,
                        "policy_versions": {g: self._service.latest(p, weights=False)[0]  # what acts next
                                            for g, p in self._lanes.policy_of.items()}}))

    def _serve(self, ws: ServerConnection, episodes: dict[str, Episode]) -> None:
        limit = self.config.max_message_bytes
        while not self._closed:
            frames = [ws.recv(timeout=self.config.idle_timeout_s)]
            # websockets' queue of frames received (an internal: without it, recv(timeout=0) tells)
            empty, closed = getattr(getattr(getattr(ws, "recv_messages", None), "frames", None), "empty", None), None
            while len(frames) < _DRAIN:
                if empty is not None and empty():
                    break  # nothing more has arrived (recv(timeout=0) would raise TimeoutError: ~8 us)
                try:
                    frames.append(ws.recv(timeout=0))
                except TimeoutError:
                    break
                except ConnectionClosed as error:  # what came before the close is served first (an end, a bye)
                    closed = error
                    break
            pending = []
            for frame in frames:
                message = decode(frame, max_bytes=limit)
                kind = message["type"]
                if kind == "act":
                    self._start_act(ws, message, episodes, pending)
                elif kind == "end":
                    self._end(ws, message, episodes)
                elif kind == "trajectory":
                    self._trajectory(ws, message, episodes)
                elif kind == "get_policy":
                    self._send_policy(ws, message)
                elif kind == "ping":
                    ws.send(encode({"type": "pong", "t": message.get("t", 0)}))
                elif kind == "bye":
                    self._answer(ws, pending, episodes)
                    return
                elif kind == "hello":
                    raise ProtocolError("bad_message", "'hello' comes once, first")
            self._answer(ws, pending, episodes)
            if closed is not None:
                raise closed

    def _start_act(self, ws, message: Mapping[str, Any], episodes: dict[str, Episode], pending: list) -> None:
        request_id = field(message, "id", int)
        name = name_field(message, "episode", request=request_id)
        what = f"act {request_id} of episode {name!r}"
        episode = episodes.get(name)
        try:
            if episode is not None and episode.waiting:
                raise ProtocolError("bad_message", f"{what}: the previous request of this episode is not answered yet",
                                    fatal=False)
            request = self._codec.parse_act(message, what)
            if episode is None:
                if len(episodes) >= self.config.max_episodes:
                    raise ProtocolError("busy", f"{what}: a connection runs at most {self.config.max_episodes} "
                                                f"episodes at once", fatal=False)
                episode = episodes[name] = Episode(self._lanes, name)
            episode.waiting = True
            with self._lock:
                self.counters["requests"] += 1
            pending.append((request_id, episode, request, request.groups_asking()))
        except ProtocolError as error:
            error.request, error.episode = request_id, name
            self._episode_error(ws, error, episodes, name)

    def _submit(self, pending: list) -> list[dict]:
        """Each pending request's futures (group -> ``.result()``): one request of one group is served at once
        when the service is idle; otherwise all are queued together and served here if no batch is running."""
        service, policy_of, timeout = self._service, self._lanes.policy_of, self.config.heartbeat_s
        if len(pending) == 1 and len(pending[0][3]) == 1:
            request, (g,) = pending[0][2], pending[0][3]
            done = service.serve_alone(policy_of[g], request.inputs(g), shared=request.shared)
            if done is not None:
                return [{g: done}]
        out = [{g: service.submit(policy_of[g], request.inputs(g), shared=request.shared, timeout_s=timeout)
                for g in groups} for _, _, request, groups in pending]
        if out:
            service.serve_queued()  # serve them here if no batch is running (no hand-off)
        return out

    def _answer(self, ws, pending: list, episodes: dict[str, Episode]) -> None:
        for (request_id, episode, request, _), futures in zip(pending, self._submit(pending)):
            try:
                results = {g: f.result() for g, f in futures.items()}
            except Exception as error:  # noqa: BLE001 - expired or failed: only this episode ends
                episode.consequences(request)  # the previous step's consequences did arrive: keep them
                self._episode_error(ws, ProtocolError("internal", f"act {request_id}: no action in time ({error})",
                                                      fatal=False, request=request_id, episode=episode.name),
                                    episodes, episode.name)
                continue
            versions = {g: r.version for g, r in results.items()}
            outputs = {g: {ACTION: results[g].action, LOG_PROB: results[g].log_prob} if g in results
                       else self._codec.empty_outputs(g) for g in self._codec.groups}  # none asked: masked zeros
            actions = action_maps({g: out[ACTION] for g, out in outputs.items()}, request.agents)
            ws.send(encode({"type": "actions", "id": request_id, "episode": episode.name, "actions": actions,
                            "version": min(versions.values()) if versions else 0}))
            # recorded after the answer left; a group no agent of which acted: its policy's version now (all masked)
            episode.consequences(request)
            now = self._service.versions
            episode.act(request, outputs, {**{g: now[p] for g, p in self._lanes.policy_of.items()}, **versions})
            episode.waiting = False

    def _end(self, ws, message: Mapping[str, Any], episodes: dict[str, Episode]) -> None:
        name = name_field(message, "episode")
        what = f"end of episode {name!r}"
        try:
            outcome = field(message, "outcome", str, fatal=False, episode=name)
            if outcome not in ("terminated", "truncated"):
                raise ProtocolError("bad_message", f"{what}: outcome must be 'terminated' or 'truncated', got {outcome!r}",
                                    fatal=False)
            episode = episodes.get(name)
            if episode is None:
                raise ProtocolError("unknown_episode", f"{what}: no such episode is running on this connection",
                                    fatal=False)
            if episode.waiting:
                raise ProtocolError("bad_message", f"{what}: its last request is not answered yet", fatal=False)
            reward, _ = self._codec.consequences(message, what)
            final = self._codec.parse_final(message, what)
        except ProtocolError as error:
            error.episode = name
            self._episode_error(ws, error, episodes, name)
            return
        episodes.pop(name).end(outcome, reward, final)

    def _episode_error(self, ws, error: ProtocolError, episodes: dict[str, Episode], name: str) -> None:
        """A non-fatal error: answered, that episode cut (its complete steps kept); a fatal one propagates."""
        if error.fatal:
            raise error
        episode = episodes.pop(name, None)
        if episode is not None:
            episode.cut()
        with self._lock:
            self.counters["protocol_errors"] += 1
            self._counted(error.code)
        ws.send(encode(error.as_message()))


__all__ = ["ExternalServer"]
