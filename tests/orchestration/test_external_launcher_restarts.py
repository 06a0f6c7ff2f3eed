"""The simulator launcher's restart pauses: a simulator that had connected and then exits is restarted after a
pause that doubles while it keeps failing; one that never connected is restarted at once; a start that stayed
connected a minute resets the pause. Real processes, a clock the test moves."""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

from orchestration.external_launcher import STABLE_S, SimulatorLauncher

# a "simulator" that runs until the file named by its first argument exists
SIM = ("import os, sys, time; "
       "[time.sleep(0.02) for _ in iter(lambda: os.path.exists(sys.argv[1]), True)]")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # exited, not yet reaped
    except (ProcessLookupError, FileNotFoundError):
        return True


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        time.sleep(0.02)


def test_a_simulator_that_had_connected_restarts_after_a_pause_that_doubles_then_resets(tmp_path):
    now, log = [0.0], io.StringIO()
    launcher = SimulatorLauncher(f'{sys.executable} -c "{SIM}" {tmp_path}/{{sim_id}}', 1, host="127.0.0.1", port=1,
                                 token="t", max_restarts=10, restart_backoff_s=1.0, clock=lambda: now[0], log=log)

    def end(sim_id: str) -> None:  # the current start exits; check() sees it at the time the test sets
        (pid,) = launcher.pids
        (tmp_path / sim_id).touch()
        _wait(lambda: _gone(pid))

    def restarted_at(t: float) -> bool:
        now[0] = t
        launcher.check(connected=set())
        return bool(launcher.pids)

    try:
        launcher.start()
        launcher.check(connected={"sim-0"})  # connected at 0
        end("sim-0")
        assert not restarted_at(10.0)  # connected, then exited: a pause of 1 s
        assert launcher.counters["simulator_restarts"] == 1 and launcher.counters["simulator_restart_pauses"] == 1
        assert not restarted_at(10.9) and restarted_at(11.0)
        assert launcher.sim_id(0) == "sim-0.1" and launcher.counters["simulators_started"] == 2

        launcher.check(connected={"sim-0.1"})  # connected at 11, exits at 12: the second in a row pauses 2 s
        end("sim-0.1")
        assert not restarted_at(12.0) and not restarted_at(13.9) and restarted_at(14.0)

        end("sim-0.2")  # never connected: restarted at once, whatever the pauses before
        assert restarted_at(15.0)
        assert launcher.counters["simulator_restart_pauses"] == 2

        launcher.check(connected={"sim-0.3"})  # connected at 15, stays a minute: the next exit restarts at once
        end("sim-0.3")
        assert restarted_at(15.0 + STABLE_S)
        launcher.check(connected={"sim-0.4"})
        end("sim-0.4")  # and the pause after a short one starts again from 1 s
        assert not restarted_at(16.0 + STABLE_S) and restarted_at(17.0 + STABLE_S)
        assert launcher.counters["simulator_restarts"] == 5 and launcher.counters["simulator_restart_pauses"] == 3
        lines = log.getvalue().splitlines()  # each restart told, not only counted in the metrics
        assert len(lines) == 5 and lines[0] == ("shoal: external simulator sim-0 exited (code 0); restarting it in 1 s "
                                                "(restart 1 of 10, --external.max-restarts)")
        assert lines[2].startswith("shoal: external simulator sim-0.2 exited (code 0); restarting it (restart 3")
    finally:
        launcher.close()


def test_a_simulator_that_connected_and_exited_between_two_checks_still_pauses(tmp_path):
    """The launcher looks now and then: a start that connected, played and exited in between was never in
    ``connected`` at a check; the server's ``welcomed`` ids tell it connected, so its restart pauses."""
    now = [0.0]
    launcher = SimulatorLauncher(f'{sys.executable} -c "{SIM}" {tmp_path}/{{sim_id}}', 1, host="127.0.0.1", port=1,
                                 token="t", max_restarts=10, restart_backoff_s=1.0, clock=lambda: now[0])
    try:
        launcher.start()
        (pid,) = launcher.pids
        (tmp_path / "sim-0").touch()
        _wait(lambda: _gone(pid))
        now[0] = 5.0
        launcher.check(connected=set(), welcomed={"sim-0"})
        assert not launcher.pids and launcher.counters["simulator_restart_pauses"] == 1
        now[0] = 6.0
        launcher.check(connected=set(), welcomed={"sim-0"})  # sim-0.1 has an id of its own: not yet welcomed
        assert launcher.pids and launcher.sim_id(0) == "sim-0.1"
    finally:
        launcher.close()
