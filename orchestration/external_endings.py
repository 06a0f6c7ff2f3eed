"""How the server ends a connection it will not keep (docs/external-protocol.md, "Security"): a refusal or fatal
protocol error is answered with an ``error`` message; a connection silent past the hello deadline or
``idle_timeout_s`` is closed with code 1008 and the reason. Each is counted, and the first few of each kind
are printed on the server's log (whoever runs the server would not know otherwise).

A mixin of :class:`orchestration.external_server.ExternalServer` (it reads the server's config, counters, lock
and log).
"""

from __future__ import annotations

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection

from adapters.external.messages import ProtocolError, encode

_TOLD = 3  # refusals, fatal protocol errors and idle closes of each kind printed on the log; the rest are counted


class ConnectionEndings:
    """Refusals and idle closes of one connection (called from its thread)."""

    def ending(self) -> None:
        """The run is ending: connections lost from now on (the launcher stopping its simulators) are counted as
        ever, but not told on the log as failures."""
        self._ending = True

    def _idle(self, state: dict) -> str:
        """Counts and logs a connection closed for silence; the close frame's reason."""
        if state["sim"] is None:
            why = f"no hello within {self.config.heartbeat_s:g} s (heartbeat_s) of connecting"
        else:
            why = f"no message for {self.config.idle_timeout_s:g} s (idle_timeout_s)"
        with self._lock:
            self.counters["idle_closed"] += 1
            told = self._told["idle"] = self._told.get("idle", 0) + 1
        if told <= _TOLD:
            more = " (further ones are only counted)" if told == _TOLD else ""
            sim = state["sim"] or state.get("hello_sim")
            print(f"shoal: external connection{f' of sim id {sim!r}' if sim else ''} closed: {why}{more}\n", end="",
                  file=self._log)
        return why

    def _lost(self, state: dict, closed: ConnectionClosed, open_episodes: int) -> None:
        """Logs a connection that ended under the server (the simulator died, stopped answering pings, or left
        with episodes open; each cut episode is counted by its lane): an end the simulator asked for with no
        episode open says nothing, and so does every end once the run is ending (``ExternalServer.ending``)."""
        sent, received = closed.sent, closed.rcvd
        if self._ending:
            return
        if sent is not None and sent.code == 1011 and "ping" in sent.reason:
            why = f"no answer to a ping within {self.config.heartbeat_s:g} s (heartbeat_s)"
        elif open_episodes == 0:
            return
        elif received is None:
            why = "it dropped without a close frame (the simulator died or the network failed)"
        else:
            why = f"the simulator closed it (code {received.code})"
        with self._lock:
            told = self._told["lost"] = self._told.get("lost", 0) + 1
        if told <= _TOLD:
            cut = f"; {open_episodes} open episode{'s' if open_episodes != 1 else ''} cut (counted in " \
                  f"episodes_cut and steps_lost)" if open_episodes else ""
            more = " (further ones are only counted)" if told == _TOLD else ""
            sim = state["sim"] or state.get("hello_sim")
            print(f"shoal: external connection{f' of sim id {sim!r}' if sim else ''} lost: {why}{cut}{more}\n", end="",
                  file=self._log)

    def _refuse(self, ws: ServerConnection, error: ProtocolError, state: dict, tell: bool = True) -> None:
        sim = state["sim"] or state.get("hello_sim")
        refused = error.code in ("bad_token", "busy", "protocol_version", "spec_mismatch")
        tell = tell and (refused or error.fatal)
        with self._lock:
            self.counters["refused" if refused else "protocol_errors"] += 1
            told = self._told[error.code] = self._told.get(error.code, 0) + tell
        if tell and told <= _TOLD:  # the simulator is told; whoever runs the server would not know
            why, more = str(error)[:300], f" (further {error.code} refusals are only counted)" if told == _TOLD else ""
            whose = (f" claiming sim id {sim!r}" if refused else f" of sim id {sim!r}") if sim else ""
            how = "refused" if refused else "closed after a fatal error"
            # a client's text: repr'd or JSON-escaped upstream, and bounded
            print(f"shoal: external connection{whose} {how}: {error.code}: {why}{more}\n", end="",
                  file=self._log)  # one write: connections' threads print side by side
        try:
            ws.send(encode(error.as_message()))
        except (ConnectionClosed, OSError):
            pass


__all__ = ["ConnectionEndings"]
