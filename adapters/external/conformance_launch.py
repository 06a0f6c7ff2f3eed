"""The conformance kit's two launches of a simulator (:mod:`adapters.external.conformance`, steps 1 and 2): each
starts a checking WebSocket server on 127.0.0.1 and a free port, runs the simulator's command in its own process
group (stderr kept for the report) and kills that group when the launch is over.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import traceback

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from adapters.external.command import render
from adapters.external.conformance_report import Findings, Report, count
from adapters.external.conformance_session import Session, SessionOptions
from adapters.external.messages import ProtocolError, encode

HOST = "127.0.0.1"
_QUIET = logging.getLogger("shoal.conformance.websockets")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class _Launch:
    """One simulator process in its own process group, stderr kept in a temporary file."""

    def __init__(self, argv: list[str], token: str) -> None:
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, SHOAL_TOKEN=token)
        self.process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=self.stderr, start_new_session=True)

    def exited(self, timeout: float = 0.0) -> bool:
        try:
            self.process.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        """Ends the whole process group (TERM, then KILL)."""
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            if self.exited(wait) and sig == signal.SIGKILL:
                break
        self.exited(2.0)

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class _Server:
    """A websockets server on 127.0.0.1 and a free port, handling each connection in its own thread."""

    def __init__(self, handler) -> None:
        self._server = serve(handler, HOST, 0, compression=None, max_size=None, ping_interval=None,
                             close_timeout=2, open_timeout=10, logger=_QUIET)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(5)


def _refuse_connection(ws: ServerConnection, code: str, text: str, timeout: float = 5.0,
                       sent: threading.Event | None = None) -> None:
    """Answers the first message with a fatal error (then sets ``sent``) and closes."""
    try:
        ws.recv(timeout=timeout)
        ws.send(encode(ProtocolError(code, text).as_message()))
        if sent is not None:
            sent.set()
        ws.close()
    except (TimeoutError, ConnectionClosed):
        pass


def main_launch(command: str, options: SessionOptions, report: Report, findings: Findings) -> None:
    """Step 1: the right token; one :class:`~adapters.external.conformance_session.Session`, more refused."""
    lock, done, connected = threading.Lock(), threading.Event(), threading.Event()
    extra = []  # one entry per later connection: whether the first was still open then

    def handler(ws: ServerConnection) -> None:
        with lock:
            first = not connected.is_set()
            connected.set()
        if not first:
            extra.append(not done.is_set())
            _refuse_connection(ws, "busy", "the conformance kit takes one connection per simulator")
            return
        try:
            Session(ws, options, findings, report).run()
        except Exception:  # noqa: BLE001 - a kit bug must show in the report, not vanish in a thread
            findings.fail("kit", f"internal error in the conformance kit:\n{traceback.format_exc()}")
        finally:
            done.set()

    server = _Server(handler)
    launch = None
    try:
        values = dict(host=HOST, port=str(server.port), seed=str(options.seed), sim_id=options.sim_id,
                      token=options.token)
        try:
            launch = _Launch(render(command, flag="--command", **values), options.token)
        except (OSError, ValueError) as error:  # not found, not executable, unbalanced quotes, unknown placeholder
            findings.fail("launch", f"cannot start the command: {error}")
            return
        deadline = time.monotonic() + options.timeout_s
        while not connected.is_set() and time.monotonic() < deadline and not launch.exited(0.05):
            pass
        if not connected.wait(1.0):
            if launch.exited():
                where = "its stderr is in the notes" if launch.stderr_text().strip() else "it wrote nothing to stderr"
                findings.fail("launch", f"the simulator exited (code {launch.process.returncode}) without connecting "
                                        f"({where})")
            else:
                findings.fail("launch", f"the simulator did not connect to ws://{HOST}:{server.port}/ within "
                                        f"{options.timeout_s:g} s")
            return
        done.wait()
        if not launch.exited(min(options.timeout_s, 5.0)):
            findings.warn("exit", f"the simulator was still running {min(options.timeout_s, 5.0):g} s after the "
                                  f"connection closed (it was killed, as the launcher would)")
        during, after = sum(extra), len(extra) - sum(extra)
        if during:
            findings.warn("connections", f"the simulator opened {count(during, 'more connection')} while its first "
                                         f"was open; each was refused with 'busy' (one connection per simulator)")
        if after:
            findings.warn("connections", f"the simulator connected again {count(after, 'time')} after its first "
                                         f"connection closed (refused with 'busy': the kit checks one connection)")
    finally:
        if launch is not None:
            launch.kill()
            code, stderr = launch.process.returncode, launch.stderr_text()
            traceback_seen = "Traceback (most recent call last)" in stderr
            report.notes.append(f"main launch: exit code {code}" + (f"; stderr ends:\n{_tail(stderr)}"
                                                                    if stderr.strip() and not traceback_seen else ""))
            if traceback_seen:
                findings.warn("traceback", f"the simulator's stderr shows a Python traceback:\n{_tail(stderr)}")
        server.close()


class _Stamped(threading.Event):
    """An event that keeps when it was first set (``at``)."""

    at = float("inf")

    def set(self) -> None:
        self.at = min(self.at, time.monotonic())
        super().set()


def token_launch(command: str, options: SessionOptions, report: Report, findings: Findings) -> None:
    """Step 2: a wrong token, refused with a fatal ``bad_token``; the simulator must exit, not reconnect."""
    refused, connections = _Stamped(), []

    def handler(ws: ServerConnection) -> None:
        connections.append(time.monotonic())
        _refuse_connection(ws, "bad_token", "the token is not this run's (the conformance kit's wrong-token check)",
                           options.timeout_s, refused)

    def reconnects() -> int:  # connections opened after a refusal was sent (not several opened at once before)
        return sum(t > refused.at for t in connections) if refused.is_set() else 0

    server = _Server(handler)
    wrong = secrets.token_hex(16)
    values = dict(host=HOST, port=str(server.port), seed=str(options.seed + 1), sim_id=options.sim_id + "-badtoken",
                  token=wrong)
    launch = None
    try:
        try:
            launch = _Launch(render(command, flag="--command", **values), wrong)
        except (OSError, ValueError) as error:
            findings.fail("token.launch", f"wrong-token launch: cannot start the command: {error}")
            return
        deadline = time.monotonic() + options.timeout_s
        while not refused.is_set() and time.monotonic() < deadline and not launch.exited(0.05):
            pass
        if connections:  # it connected: the refusal may still be on its way out of the handler thread
            refused.wait(min(options.timeout_s, 5.0))
        if not refused.is_set():
            if launch.exited():
                findings.warn("token.no_connect", f"wrong-token launch: exited (code {launch.process.returncode}) "
                                                  f"without {'a hello' if connections else 'connecting'}")
            else:
                findings.fail("token.no_connect", f"wrong-token launch: no hello within {options.timeout_s:g} s")
            return
        deadline = time.monotonic() + options.timeout_s
        while time.monotonic() < deadline and reconnects() < 3 and not launch.exited(0.05):
            pass
        if reconnects() >= 3:
            findings.fail("token.reconnect", f"after a fatal bad_token error the simulator reconnected "
                                             f"{reconnects()} times within {connections[-1] - connections[0]:.2f} s "
                                             f"(a reconnect loop; a fatal error means stop)")
        elif not launch.exited():
            findings.fail("token.hang", f"the simulator was still running {options.timeout_s:g} s after a fatal "
                                        f"bad_token error (it should exit)")
        elif reconnects():  # the token will not change: a fatal error means stop
            findings.fail("token.reconnect", f"after a fatal bad_token error the simulator reconnected "
                                             f"{reconnects()} time(s) before exiting (a fatal error means exit "
                                             f"without reconnecting)")
    finally:
        if launch is not None:
            exited = launch.exited()
            launch.kill()
            stderr = launch.stderr_text()
            report.notes.append(f"wrong-token launch: {len(connections)} connection(s), "
                                + (f"exit code {launch.process.returncode}" if exited else "killed"))
            if "Traceback (most recent call last)" in stderr:
                findings.warn("token.traceback", f"wrong-token launch: the simulator's stderr shows a Python "
                                                 f"traceback:\n{_tail(stderr)}")
        server.close()


__all__ = ["HOST", "main_launch", "token_launch"]
