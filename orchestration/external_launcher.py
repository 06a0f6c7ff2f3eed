"""Launching external simulators (seed 002): ``instances`` processes from a command template, restarted when
they exit or do not connect in time, killed with their whole process group at the end.

Restarts: a start that never connected is restarted at once (a wrong command then fails within seconds, after
``max_restarts``). One that had connected is restarted after a pause of ``restart_backoff_s``, doubled for
each such restart of that simulator in a row, at most :data:`MAX_BACKOFF_S`; a start that stayed connected
:data:`STABLE_S` resets the doubling. So a simulator that works, then fails for a while (a licence server or
a robot's network down), does not use up every restart within seconds.

The template is :func:`adapters.external.command.render`'s (split like a POSIX shell, no shell ever runs it;
placeholders ``{host}``, ``{port}``, ``{seed}``, ``{sim_id}``, ``{token}``). Each simulator also gets
``SHOAL_TOKEN``, ``SHOAL_HOST``, ``SHOAL_PORT``, ``SHOAL_SEED`` and ``SHOAL_SIM_ID`` in its environment, and a
process group of its own (``start_new_session``), so that closing kills whatever it started too.

Usage (what :class:`orchestration.external_fleet.ExternalFleet` does)::

    launcher = SimulatorLauncher(command, 4, host=server.config.host, port=server.port, token=server.token, seed=0)
    launcher.start()
    launcher.check(server.connected, server.welcomed)   # now and then: restarts exited simulators and ones
                                                        # that never connected
    launcher.close()
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Collection, TextIO

from adapters.external.command import render

#: Longest pause before restarting a simulator that had connected.
MAX_BACKOFF_S = 60.0
#: A start connected this long resets its simulator's pause to ``restart_backoff_s``.
STABLE_S = 60.0


class NoSimulatorData(RuntimeError):
    """No external simulator delivered data for ``external.wait_s`` seconds (none connected, or every one
    refused or silent): the user's to fix, told in one paragraph by the ``shoal`` command."""


class SimulatorsFailed(RuntimeError):
    """A launched simulator kept exiting or never connecting, and the launcher used all its restarts. The
    message names the simulator, what happened, and where its output is: a user's error (a wrong command
    template, a simulator that cannot reach the server), told in one paragraph by the ``shoal`` command."""


class SimulatorLauncher:
    """Starts and watches ``instances`` simulators (module docstring).

    Args:
        command: the template.
        instances: simulators kept running.
        host, port, token: the server's address and token.
        seed: simulator ``i``'s ``k``-th start gets ``seed + 1000 * i + 10**6 * k``.
        start_timeout_s: a simulator not connected this long after its start is killed and started again.
        max_restarts: restarts allowed over the launcher's life; one more raises :class:`SimulatorsFailed`.
        log_dir: each simulator's stdout and stderr go to ``log_dir/<sim_id>.log`` (None: discarded).
        restart_backoff_s: first pause before restarting a simulator that had connected (module docstring).
        clock: monotonic seconds (time is an argument: tests pass their own).
        refusal_of: why the server refused the connection claiming a sim id, worded, or ""
            (``ExternalServer.refusal_of``), for the message of a simulator that never got in; None: not known.
    """

    def __init__(self, command: str, instances: int, *, host: str, port: int, token: str, seed: int = 0,
                 start_timeout_s: float = 60.0, max_restarts: int = 20, log_dir: str | Path | None = None,
                 restart_backoff_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 log: TextIO | None = None, refusal_of: Callable[[str], str] | None = None) -> None:
        render(command, host=host, port=port, seed=seed, sim_id="sim-0", token=token)  # fails early, named
        self._log = log  # a line per restart (what the counters say only in the metrics)
        self._refusal_of = refusal_of
        self.command, self.instances = command, instances
        self.host, self.port, self.token, self.seed = host, port, token, seed
        self.start_timeout_s, self.max_restarts = start_timeout_s, max_restarts
        self.restart_backoff_s, self._clock = restart_backoff_s, clock
        self.log_dir = Path(log_dir) if log_dir else None
        self._procs: list[subprocess.Popen | None] = [None] * instances
        self._started = [0.0] * instances
        self._starts = [0] * instances
        self._seen: list[bool] = [False] * instances
        self._unconnected = [0] * instances  # consecutive starts of each simulator that ended without connecting
        self._connected_at: list[float | None] = [None] * instances  # when check() first saw the start connected
        self._short = [0] * instances  # consecutive connected starts of each simulator that ended before STABLE_S
        self._relaunch_at: list[float | None] = [None] * instances  # a paused restart's time
        self.counters = dict(simulators_started=0, simulator_restarts=0, simulator_exits=0, simulator_start_timeouts=0,
                             simulator_restart_pauses=0)
        self._closed = False

    def sim_id(self, index: int) -> str:
        """The id simulator ``index`` presents in its current start (``sim-<index>`` then ``sim-<index>.<k>``)."""
        k = self._starts[index] - 1
        return f"sim-{index}" if k <= 0 else f"sim-{index}.{k}"

    def start(self) -> None:
        for i in range(self.instances):
            self._launch(i)

    def _launch(self, i: int) -> None:
        self._starts[i] += 1
        sim_id = self.sim_id(i)
        seed = self.seed + 1000 * i + 10**6 * (self._starts[i] - 1)
        args = render(self.command, host=self.host, port=self.port, seed=seed, sim_id=sim_id, token=self.token)
        env = {**os.environ, "SHOAL_TOKEN": self.token, "SHOAL_HOST": self.host, "SHOAL_PORT": str(self.port),
               "SHOAL_SEED": str(seed), "SHOAL_SIM_ID": sim_id,
               "PYTHONUNBUFFERED": "1"}  # a Python simulator's last lines reach its log even when it is killed
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{sim_id}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            self._procs[i] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                              start_new_session=True)
        except OSError as error:
            raise ValueError(f"--external.command: cannot start {args[0]!r}: {error}") from None
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self._started[i] = self._clock()
        self._seen[i], self._connected_at[i], self._relaunch_at[i] = False, None, None
        self.counters["simulators_started"] += 1

    def check(self, connected: Collection[str], welcomed: Collection[str] = ()) -> None:
        """Restarts simulators that exited, and ones not connected ``start_timeout_s`` after their start (those
        that had connected after a pause: module docstring). ``connected``: sim ids connected now; ``welcomed``:
        sim ids that ever completed a hello (each start has its own id), so a start that connected and exited
        between two checks still counts as connected."""
        if self._closed:
            return
        now = self._clock()
        for i, proc in enumerate(self._procs):
            if proc is None:
                if self._relaunch_at[i] is not None and now >= self._relaunch_at[i]:
                    self._launch(i)
                continue
            if not self._seen[i] and (self.sim_id(i) in connected or self.sim_id(i) in welcomed):
                self._seen[i], self._connected_at[i] = True, now
            exited = proc.poll() is not None
            late = not self._seen[i] and now - self._started[i] > self.start_timeout_s
            if not (exited or late):
                continue
            self.counters["simulator_exits" if exited else "simulator_start_timeouts"] += 1
            self._unconnected[i] = 0 if self._seen[i] else self._unconnected[i] + 1
            _kill_group(proc)
            if self.counters["simulator_restarts"] >= self.max_restarts:
                raise SimulatorsFailed(f"external simulator {self.sim_id(i)} {'exited' if exited else 'never connected'}"
                                       f" and the launcher used all {self.max_restarts} restarts "
                                       f"(--external.max-restarts)"
                                       f"{self._hint(i)}; its output is in {self.log_dir or 'nowhere: set run_dir'}"
                                       f"{self._last_words(i)}")
            self.counters["simulator_restarts"] += 1
            pause = self._pause(i, now)
            if self._log is not None and self._unconnected[i] <= 1:  # a wrong command: told once, not per restart
                why = f"exited (code {proc.returncode})" if exited else f"did not connect in {self.start_timeout_s:g} s"
                print(f"shoal: external simulator {self.sim_id(i)} {why}; restarting it"
                      + (f" in {pause:g} s" if pause else "") + f" (restart {self.counters['simulator_restarts']} "
                      f"of {self.max_restarts}, --external.max-restarts)"
                      + ("; its next starts that end before connecting are counted, not told" * self._unconnected[i]),
                      file=self._log)
            if pause:
                self._procs[i], self._relaunch_at[i] = None, now + pause
                self.counters["simulator_restart_pauses"] += 1
            else:
                self._launch(i)

    def _pause(self, i: int, now: float) -> float:
        """Seconds before restarting simulator ``i``, whose start just ended (module docstring)."""
        if not self._seen[i]:
            return 0.0
        stable = now - self._connected_at[i] >= STABLE_S
        self._short[i] = 0 if stable else self._short[i] + 1
        return 0.0 if stable else min(self.restart_backoff_s * 2 ** (self._short[i] - 1), MAX_BACKOFF_S)

    def _last_words(self, i: int) -> str:
        """The last line simulator ``i`` wrote to its log, quoted for a message (often the reason it failed)."""
        if self.log_dir is None:
            return ""
        try:
            with open(self.log_dir / f"{self.sim_id(i)}.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return f" (its last line: {lines[-1][:300]!r})" if lines else ""

    def _hint(self, i: int) -> str:
        k = self._unconnected[i]
        if k < 2:
            return ""
        refused = self._refusal_of(self.sim_id(i)) if self._refusal_of is not None else ""
        if refused:  # its last start reached the server, which turned it away
            return f"; none of its last {k} starts was let in: {refused}"
        return (f"; none of its last {k} starts connected to the server: check external.command (does it pass "
                f"{{port}} and {{token}}, or read SHOAL_PORT and SHOAL_TOKEN?)")

    def summary(self) -> str:
        """What the simulators did so far, for a message: starts, exits, start timeouts, where the logs are."""
        c = self.counters
        return (f"the launcher started simulators {c['simulators_started']} times ({c['simulator_exits']} exited, "
                f"{c['simulator_start_timeouts']} did not connect in time); their output is in "
                f"{self.log_dir or 'nowhere: set run_dir'}")

    @property
    def pids(self) -> list[int]:
        """Process ids of the current simulators (for monitoring and fault-injection tests)."""
        return [p.pid for p in self._procs if p is not None]

    def close(self, grace_s: float = 2.0) -> None:
        """Terminates every simulator's process group (SIGTERM, then SIGKILL after ``grace_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        live = [p for p in self._procs if p is not None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(p)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group leader's pid is the group id (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


__all__ = ["NoSimulatorData", "SimulatorLauncher", "SimulatorsFailed", "render"]
