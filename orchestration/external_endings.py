"""How the server ends a connection it will not keep (docs/external-protocol.md, "Security"): a refusal or fatal
protocol error is answered with an ``error`` message; a connection silent past the hello deadline or
``idle_timeout_s`` is closed with code 1008 and the reason. Each is counted, and the first few of each kind
are printed on the server's log (whoever runs the server would not know otherwise).

A mixin of :class:`orchestration.external_server.ExternalServer` (it reads the server's config, counters, lock
and log).
"""

from __future__ import annotations

from typing import Mapping

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection

from adapters.external.messages import ProtocolError, encode

_REFUSED_KEPT = 1024  # sim ids whose refusal is remembered (a launcher asks about its own starts)
_TOLD = 3  # refusals, fatal protocol errors and idle closes of each kind printed on the log; the rest are counted

#: What a refusal or error code most often means, for a run that ends without data (:meth:`refusals`).
_CAUSES = {
    "bad_token": "the simulators' token is not the run's, in run_dir/external_token or --external.token",
    "spec_mismatch": "their tree differs from the run's, in run_dir/tree.json or --external.tree",
    "protocol_version": "they speak another protocol version",
    "busy": "more simulators than --external.max-simulators, or more open episodes on one connection than "
            "--external.max-episodes: does each episode end?",
}


class ConnectionEndings:
    """Refusals and idle closes of one connection (called from its thread)."""

    def ending(self) -> None:
        """The run is ending: connections lost from now on (the launcher stopping its simulators) are counted as
        ever, but not told on the log as failures."""
        self._ending = True

    def refusals(self, since: Mapping[str, int] | None = None) -> str:
        """The refusals that keep simulators from acting (:data:`_CAUSES`' codes: a token, a tree, a protocol
        version, busy) answered so far, or since ``since`` (an earlier copy of :attr:`errors`), with their likely
        causes, for a message that says why no data came ("" when none): e.g. ``"the server answered bad_token 3
        times (the simulators' token is not the run's, ...); its log names the first of each"``."""
        with self._lock:
            counts = {c: n - (since or {}).get(c, 0) for c, n in self.errors.items() if c in _CAUSES}
        answered = sorted(((c, n) for c, n in counts.items() if n > 0), key=lambda item: -item[1])
        if not answered:
            return ""
        parts = [f"{code} {n} time{'s' if n != 1 else ''} ({_CAUSES[code]})" for code, n in answered]
        return f"the server answered {', '.join(parts)}; its log names the first of each"

    def refusal_of(self, sim_id: str) -> str:
        """Why the connection claiming ``sim_id`` was refused, worded ("" if it was not, or is forgotten)."""
        with self._lock:
            code = self.refused_sims.get(sim_id)
        return f"the server refused {sim_id} with {code} ({_CAUSES.get(code, 'its log says why')})" if code else ""

    def _counted(self, code: str, sim: str | None = None) -> None:
        """One more refusal or error answered with ``code`` (call under the lock); a refusal of ``sim`` is kept
        for :meth:`refusal_of` (the newest :data:`_REFUSED_KEPT`)."""
        self.errors[code] = self.errors.get(code, 0) + 1
        if sim is not None:
            self.refused_sims[sim] = code
            if len(self.refused_sims) > _REFUSED_KEPT:
                del self.refused_sims[next(iter(self.refused_sims))]

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
            self._counted(error.code, sim if refused else None)
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
