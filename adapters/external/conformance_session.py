"""One checked connection of the conformance kit's main launch: the kit plays a Shoal server.

:class:`Session` answers the ``hello`` with a ``welcome`` and every ``act`` with random legal actions (several
pending answers in shuffled order, holding now and then so pipelined requests show), refuses one ``act`` on
purpose with a non-fatal error, and closes once enough episodes ended. It keeps the connection's state (episodes
running and ended, unanswered requests), checks what depends on it (request and episode ids, one outstanding
``act`` per episode), hands each message's fields to :mod:`adapters.external.conformance_checks`, and ends with
the coverage warnings.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection

from adapters.external.conformance_actions import random_action
from adapters.external.conformance_checks import (Checked, EpisodeState, KitTree, abandoned, abandoned_note, check_act,
                                                  check_end, check_hello)
from adapters.external.conformance_report import Findings, Report, coverage_warnings, describe, short
from adapters.external.conformance_uploads import check_trajectory, policy_message
from adapters.external.messages import (CLIENT_TYPES, MAX_NAME, PROTOCOL_VERSION, ProtocolError, decode, encode,
                                        to_array)
from core.specs import Leaf

MAX_MESSAGE_BYTES = 1 << 20
MAX_EPISODES = 16
HOLD_EVERY, HOLD_S = 8, 0.05  # every 8th act and every episode's second act wait a little before answering
MAX_FAILURE_EVENTS = 200  # a simulator that repeats one fault forever ends the launch


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionOptions:
    """What a session needs of the run (:func:`adapters.external.conformance.run_conformance`'s arguments)."""

    token: str
    """The run's token."""
    episodes: int
    """Episodes to see ended before the kit closes."""
    timeout_s: float
    """Longest wait for a message; also ``heartbeat_s`` and ``idle_timeout_s`` of the welcome."""
    max_acts: int
    """The kit closes after this many acts."""
    seed: int
    """Seed of the launch and of the random actions."""
    sim_id: str
    """``{sim_id}`` of the main launch."""
    sim_id_given: bool
    """Whether the command holds ``{sim_id}`` (the hello's sim_id is then expected to be it)."""


class Session:
    """Drives and checks one connection; :meth:`run` until the launch is over, its findings in ``findings``."""

    def __init__(self, ws: ServerConnection, options: SessionOptions, findings: Findings, report: Report) -> None:
        self.ws, self.o, self.f, self.report = ws, options, findings, report
        self.rng = np.random.default_rng(options.seed)
        self.tree: KitTree | None = None
        self.frames, self.where = 0, "connection"
        self.episodes: dict[str, EpisodeState] = {}
        self.ended: dict[str, str] = {}  # episode -> how it ended
        self.queue: list[dict[str, Any]] = []
        self.queued_ids: set[int] = set()
        self.injected: str | None = None  # the episode refused on purpose
        self.recovered = self.stop = self.bye = self.kit_closed = self.closed_by_sim = False
        self.ping_event: threading.Event | None = None
        self.ping_sent = 0.0
        self.hold = False  # wait HOLD_S for more requests before answering (catches a second outstanding act)
        self.cover: set[str] = set()

    # -- loop -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            message = self._next("the hello")
            if message is None or not self._hello(message):
                return
            self._send({"type": "welcome", "protocol": PROTOCOL_VERSION, "session": f"conformance-"
                        f"{secrets.token_hex(4)}", "spec_hash": self.tree.hash, "heartbeat_s": float(self.o.timeout_s),
                        "idle_timeout_s": float(self.o.timeout_s), "max_message_bytes": MAX_MESSAGE_BYTES,
                        "max_episodes": MAX_EPISODES, "policy_versions": {g: 0 for g in self.tree.codec.groups}})
            self.ping_event, self.ping_sent = self.ws.ping(), time.monotonic()
            while not self.stop:
                message = self._next("a message")
                if message is None:
                    break
                self._handle(message)
                self._drain()
                self._flush()
                self._check_done()
        except ConnectionClosed as closed:
            self._closed(closed)
        finally:
            self._finish()

    def _next(self, what: str, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message, or None when the launch is over (closed, silent or undecodable)."""
        try:
            frame = self.ws.recv(timeout=self.o.timeout_s if timeout is None else timeout)
        except TimeoutError:
            if timeout is not None:
                raise
            self.f.fail("idle", f"after {self.where}: no message for {self.o.timeout_s:g} s while waiting for {what} "
                                f"(the server closes a connection silent for idle_timeout_s)")
            self.stop = True
            return None
        self.frames += 1
        self.where = f"message #{self.frames}"
        try:
            message = decode(frame, max_bytes=MAX_MESSAGE_BYTES, allowed=CLIENT_TYPES)
        except ProtocolError as error:
            self.f.fail(f"frame:{'text frame' if isinstance(frame, str) else error.code}", f"{self.where}: {error}")
            self._fatal(error.code, str(error))
            return None
        self.where = describe(self.frames, message)
        return message

    def _drain(self) -> None:
        """Reads what else has arrived (holding every few acts) so pipelined requests show before answers."""
        deadline = time.monotonic() + (HOLD_S if self.hold else 0.0)
        self.hold = False
        for _ in range(256):  # answer at some point even under a flood
            if self.stop:
                return
            try:
                message = self._next("", timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return
            if message is None:
                return
            self._handle(message)

    def _check_done(self) -> None:
        if self.stop:
            return
        ended, acts = len(self.ended), self.report.acts
        if ended >= self.o.episodes and (self.injected is None or self.recovered):
            self.stop = self.kit_closed = True
        elif acts >= self.o.max_acts:
            self.f.warn("max_acts", f"stopped after {acts} acts with {ended} of {self.o.episodes} episodes ended")
            self.stop = self.kit_closed = True
        elif self.frames >= 4 * self.o.max_acts:
            self.f.warn("max_messages", f"stopped after {self.frames} messages with {ended} of {self.o.episodes} "
                                        f"episodes ended")
            self.stop = self.kit_closed = True
        elif self.f.failure_events >= MAX_FAILURE_EVENTS:
            self.report.notes.append(f"stopped after {MAX_FAILURE_EVENTS} failures")
            self.stop = self.kit_closed = True

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "act":
            self._act(message)
        elif kind == "end":
            self._end(message)
        elif kind == "ping":
            self.cover.add("pings")
            t = message.get("t", 0)
            if "t" in message and (isinstance(t, bool) or not isinstance(t, (int, float))):
                self.f.fail("ping.t", f"{self.where}: 't' must be a number, got a {type(t).__name__}")
            self.queue.append({"type": "pong", "t": t})
        elif kind == "bye":
            self.bye = self.stop = True
        elif kind == "pong":
            pass  # allowed (the page's table), though the kit sends no 'ping' message to answer
        elif kind == "hello":
            self.f.fail("hello.twice", f"{self.where}: a second hello (hello comes once, first)")
            self._fatal("bad_message", "'hello' comes once, first")
        elif kind == "get_policy":
            self.queue.append(policy_message(self.tree, message.get("id")))
        elif kind == "trajectory":
            self._trajectory(message)
        else:  # a message type the kit does not check yet
            self.f.warn(f"unchecked.{kind}", f"{self.where}: the kit does not check {kind!r} messages (not answered)")

    def _trajectory(self, message: dict[str, Any]) -> None:
        """An upload of steps the simulator acted itself (:mod:`adapters.external.conformance_uploads`)."""
        request = message.get("id")
        name = self._episode_name(message, request)
        if name is None:
            return
        if name in self.ended:
            self.f.fail("trajectory.ended", f"{self.where}: a trajectory for episode {name!r}, which already ended "
                                            f"({self.ended[name]})")
            self._refuse("spec_violation", f"episode {name!r} has ended", request=request, episode=name)
            return
        episode = self.episodes.setdefault(name, EpisodeState())
        checked, steps, joined = check_trajectory(message, self.tree, f"trajectory {request} of episode {name!r}",
                                                  episode)
        self._record(checked)
        self.report.uploaded += steps
        self.report.joined += joined
        self.report.left += len(checked.left)
        if checked.fatal is not None:
            self._fatal(*checked.fatal)
        elif checked.failures:
            self._refuse("spec_violation", checked.failures[0][1], request=request, episode=name)
            self._end_episode(name, "refused by the kit")
        else:
            if message.get("end") is not None:
                self._end_episode(name, "by its trajectory's end")
            self.queue.append({"type": "accepted", "id": request, "episode": name, "steps": steps})

    def _record(self, checked: Checked) -> None:
        """A message's findings, each prefixed with the message."""
        for key, text in checked.failures:
            self.f.fail(key, f"{self.where}: {text}")
        for key, text in checked.warnings:
            self.f.warn(key, f"{self.where}: {text}")
        self.report.notes.extend(checked.notes)
        self.cover |= checked.covered

    # -- messages -------------------------------------------------------------------------------------------
    def _hello(self, message: dict[str, Any]) -> bool:
        checked, self.tree = check_hello(message, token=self.o.token,
                                         sim_id=self.o.sim_id if self.o.sim_id_given else None)
        self._record(checked)
        if checked.fatal is not None:
            self._fatal(*checked.fatal)
        return self.tree is not None

    def _act(self, message: dict[str, Any]) -> None:
        self.report.acts += 1
        request = message.get("id")
        if not isinstance(request, int) or isinstance(request, bool):
            self.f.fail("act.id", f"{self.where}: 'id' must be an int, got {short(request)}")
            self._fatal("bad_message", "act without an int 'id'")
            return
        if request in self.queued_ids:
            self.f.fail("act.id_reused", f"{self.where}: id {request} is already used by an unanswered act")
        name = self._episode_name(message, request)
        if name is None:
            return
        if name in self.ended:
            injected = self.ended[name] == "injected"
            how = ("the kit's non-fatal error ended it: a simulator goes on with a NEW episode id" if injected
                   else f"it ended ({self.ended[name]}); ids are never reused")
            self.f.fail("act.after_refusal" if injected else "act.reused", f"{self.where}: episode {name!r} reused: "
                                                                           f"{how}")
            self._refuse("spec_violation", f"episode {name!r} has ended", request=request, episode=name)
            return
        episode = self.episodes.get(name)
        if episode is None:
            open_now = sum(1 for e in self.episodes if e not in self.ended)
            if open_now >= MAX_EPISODES:
                idle = abandoned(self.episodes, self.ended, self.report.acts)
                self.f.fail("act.busy", f"{self.where}: a new episode while {open_now} are open; welcome said "
                                        f"max_episodes={MAX_EPISODES}{'; ' + abandoned_note(idle) if idle else ''}")
            episode = self.episodes[name] = EpisodeState()
            self.recovered = self.recovered or self.injected is not None
        elif episode.pending is not None:
            self.f.fail("act.outstanding", f"{self.where}: act {episode.pending} of this episode is still unanswered "
                                           f"(within one episode, send the next act only after the answer)")
            self._refuse("spec_violation", "one outstanding act per episode", request=request, episode=name)
            self._end_episode(name, "refused by the kit")
            return
        if any(e.pending is not None for k, e in self.episodes.items() if k != name):
            self.cover.add("pipelined")
        episode.acts += 1
        self.hold = self.hold or episode.acts == 2 or self.report.acts % HOLD_EVERY == 3
        checked = check_act(message, self.tree, episode)
        self._record(checked)
        if checked.fatal is not None:  # a malformed array: the server closes the connection
            self._fatal(*checked.fatal)
            return
        if checked.failures:
            self._refuse("spec_violation", checked.failures[0][1], request=request, episode=name)
            self._end_episode(name, "refused by the kit")
            return
        agents = message["agents"]
        if episode.acts > 1:
            self.report.joined += len(set(agents) - episode.seen)
        self.report.left += len(checked.left)
        episode.seen |= set(agents)
        episode.gone |= checked.left
        episode.last.update(dict.fromkeys(agents, episode.acts))
        episode.at = self.report.acts
        if self.injected is None and episode.acts == 2:
            self.injected = name
            self.cover.add("error")
            self._refuse("spec_violation", "conformance kit: this act is refused on purpose (a non-fatal error): "
                                           "the episode is over; carry on with a new episode id",
                         request=request, episode=name)
            self._end_episode(name, "injected")
            return
        actions = {}
        for agent, entry in agents.items():
            mask = to_array(entry["action_mask"], "mask") if "action_mask" in entry else None
            actions[agent] = random_action(self.tree.agents[agent].action, self.rng, mask)
        episode.pending = request
        self.queued_ids.add(request)
        self.queue.append({"type": "actions", "id": request, "episode": name, "actions": actions, "version": 0})

    def _episode_name(self, message: dict[str, Any], request: int | None = None) -> str | None:
        name = message.get("episode")
        if isinstance(name, str) and 1 <= len(name) <= MAX_NAME:
            return name
        self.f.fail(f"{message['type']}.episode", f"{self.where}: 'episode' must be a string of 1-{MAX_NAME} "
                                                  f"characters, got {short(name)}")
        self._refuse("bad_message", "bad episode id", request=request)
        return None

    def _end(self, message: dict[str, Any]) -> None:
        name = self._episode_name(message)
        if name is None:
            return
        if name not in self.episodes:
            self.f.fail("end.unknown", f"{self.where}: end for episode {name!r}, which never started (an episode "
                                       f"starts with its first act)")
            self._refuse("unknown_episode", f"episode {name!r} never started", episode=name)
            return
        if name in self.ended:
            how = ("the kit's non-fatal error already ended it" if self.ended[name] == "injected"
                   else f"it already ended ({self.ended[name]})")
            self.f.fail("end.ended", f"{self.where}: end for episode {name!r}, but {how}")
            return
        checked = check_end(message, self.tree, self.episodes[name])
        self._record(checked)
        if checked.fatal is not None:
            self._fatal(*checked.fatal)
            return
        if checked.failures:
            key, text = checked.failures[0]  # the server's code: a missing or bad outcome is a bad message
            self._refuse("bad_message" if key == "end.outcome" else "spec_violation", text, episode=name)
        self._end_episode(name, "by its end message")

    def _end_episode(self, name: str, how: str) -> None:
        self.ended[name] = how
        self.report.episodes = len(self.ended)

    # -- sending --------------------------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        self.ws.send(encode(message))

    def _flush(self) -> None:
        if len(self.queue) > 1:
            self.rng.shuffle(self.queue)
        for message in self.queue:
            self._send(message)
            episode = self.episodes.get(message.get("episode"))
            if message["type"] == "actions" and episode is not None and episode.pending == message["id"]:
                episode.pending = None
        self.queue, self.queued_ids = [], set()

    def _refuse(self, code: str, text: str, *, request: int | None = None, episode: str | None = None) -> None:
        """Queues the non-fatal error a server would answer with."""
        self.queue.append(ProtocolError(code, text, fatal=False, request=request, episode=episode).as_message())

    def _fatal(self, code: str, text: str) -> None:
        self._flush()
        self._send(ProtocolError(code, text).as_message())
        self.stop = self.kit_closed = True

    # -- the end of the launch ------------------------------------------------------------------------------
    def _closed(self, closed: ConnectionClosed) -> None:
        if self.stop:
            return
        self.stop = self.closed_by_sim = True
        code = closed.rcvd.code if closed.rcvd is not None else "none (no close frame)"
        if self.injected is not None and not self.recovered:
            self.f.fail("error.stopped", f"after {self.where}: the connection closed (close code {code}) after the "
                                         f"kit's non-fatal error for episode {self.injected!r}; a non-fatal error "
                                         f"ends one episode, and the simulator should carry on with a new one")
        elif len(self.ended) < self.o.episodes:
            self.f.fail("stopped", f"after {self.where}: the simulator closed the connection (close code {code}, no "
                                   f"bye) after {len(self.ended)} of {self.o.episodes} episodes: a crash? (its stderr "
                                   f"is in the notes; a simulator under the kit plays until the server closes)")

    def _finish(self) -> None:
        if self.tree is None:
            return
        if self.bye and len(self.ended) < self.o.episodes:
            self.f.fail("stopped", f"{self.where}: bye after {len(self.ended)} of {self.o.episodes} episodes (a "
                                   f"simulator under the kit plays until the server closes; or lower --episodes)")
        if idle := abandoned(self.episodes, self.ended, self.report.acts):
            self.f.fail("episode.abandoned", f"{abandoned_note(idle)}: a server counts an episode open until its "
                                             f"'end', and past max_episodes refuses new ones with 'busy'")
        if self.injected is not None and not self.recovered and not self.closed_by_sim:
            self.f.fail("error.stopped", f"no new episode after the kit's non-fatal error for episode "
                                         f"{self.injected!r} (the last message was {self.where})")
        grace = max(0.2, 2.0 - (time.monotonic() - self.ping_sent))
        if self.ping_event is not None and not self.closed_by_sim and not self.ping_event.wait(timeout=grace):
            self.f.fail("ws_ping", "a WebSocket ping frame sent after the welcome was never answered with a pong "
                                   "frame (the server closes connections that do not answer within heartbeat_s)")
        discrete = any(isinstance(a.action, Leaf) and a.action.kind == "discrete" for a in self.tree.agents.values())
        for key, text in coverage_warnings(self.cover, self.report, discrete_actions=discrete):
            self.f.warn(key, text)
        if self.kit_closed:
            try:
                self.ws.close()
            except Exception:  # noqa: BLE001 - already gone
                pass


__all__ = ["MAX_EPISODES", "MAX_MESSAGE_BYTES", "Session", "SessionOptions"]
