"""External environments: a user's setup mistakes are refused with the flag at fault named, and the ``shoal``
command tells them in one paragraph (exit status 2, no traceback)."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest

from orchestration.config import ExternalConfig
from orchestration.addresses import server_url
from orchestration.external_server import ExternalServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from external_sim import TREE  # noqa: E402


def test_setup_mistakes_name_the_flag_at_fault(tmp_path):
    """A taken port, a host that is not this machine's, TLS files that do not load: ValueErrors (the CLI tells
    them in one paragraph) naming the flags, never an OSError from deep in the socket layer."""
    taken = ExternalServer(ExternalConfig(), log=io.StringIO()).start()
    try:
        with pytest.raises(ValueError, match=rf"--external.host '127.0.0.1', --external.port {taken.port}: .*in use"):
            ExternalServer(ExternalConfig(port=taken.port), log=io.StringIO()).start()
    finally:
        taken.close()
    with pytest.raises(ValueError, match=r"external.host 'nohost.invalid'"):
        ExternalServer(ExternalConfig(host="nohost.invalid", insecure=True), log=io.StringIO()).start()
    missing = str(tmp_path / "cert.pem")
    with pytest.raises(ValueError, match=rf"--external.tls-cert '{missing}' and --external.tls-key .*cannot load them"):
        ExternalServer(ExternalConfig(tls_cert=missing, tls_key=missing), log=io.StringIO()).start()
    assert server_url("::1", 80, False) == "ws://[::1]:80" and server_url("a.b", 1, True) == "wss://a.b:1"


def test_the_cli_tells_external_setup_mistakes_in_one_paragraph(tmp_path, capsys, monkeypatch):
    from orchestration import run_loop
    from orchestration.cli import main
    from orchestration.external_launcher import SimulatorsFailed

    def told(*argv: str) -> str:
        with pytest.raises(SystemExit) as stop:
            main(list(argv))
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "Traceback" not in err, err
        return err

    assert "shoal serve: it trains on external environments only, not --env CartPole-v1" in told(
        "serve", "--env", "CartPole-v1")
    (tmp_path / "tree.json").write_text(json.dumps({"format": "shoal.tree/1", "tree": {"array": {
        "template": {"action": TREE["tree"]["array"]["template"]["action"]}, "capacity": 1}}}))
    assert "--policy.recurrent: external environments are served by feed-forward policies only" in told(
        "serve", "--policy.recurrent", "--external.port", "0")  # refused before serving, not at the first update
    assert "is not a tree document (missing key 'observation')" in told(
        "serve", "--external.tree", str(tmp_path / "tree.json"))
    crash = f"{sys.executable} -c \"import sys; sys.exit('boom: cannot load level')\""
    err = told("train", "--env", "external", "--external.command", crash, "--external.max-restarts",
               "2", "--iterations", "1", "--no-progress", "--run-dir", str(tmp_path / "run"))  # exits, never connects
    assert "used all 2 restarts (--external.max-restarts); none of its last 3 starts connected" in err, err
    assert err.count("restarting it") == 1 and "next starts that end before connecting are counted, not told" in err
    assert f"its output is in {tmp_path / 'run' / 'simulators'} (its last line: 'boom: cannot load level')" in err, err

    (tmp_path / "good.json").write_text(json.dumps(TREE))  # served, but no simulator ever connects
    err = told("serve", "--external.tree", str(tmp_path / "good.json"), "--external.port", "0", "--external.wait-s", "1",
               "--iterations", "1", "--no-progress", "--run-dir", str(tmp_path / "idle"))
    assert "no data from any external simulator for 1 s (0 connected to ws://127.0.0.1:" in err, err
    assert err.strip().splitlines()[-1].startswith("shoal serve: no data") and "--external.wait-s sets this" in err
    # a supervisor restarting the run while the simulators are away: the same state is never written again
    # (copies would push the run's older checkpoints out of the three kept)
    for _ in range(2):
        told("serve", "--resume", "--run-dir", str(tmp_path / "idle"), "--external.port", "0", "--no-progress")
    assert [p.name for p in (tmp_path / "idle" / "checkpoints").glob("ckpt-*")] == ["ckpt-000000"]

    def failing(*args):  # the same error once training runs: a checkpoint is written, then one paragraph
        raise SimulatorsFailed("external simulator sim-1 exited ...")

    monkeypatch.setattr(run_loop, "run_training", failing)
    args = ("train", "builtin:cartpole", "--iterations", "1", "--no-progress", "--run-dir", str(tmp_path / "cp"))
    assert "shoal train: external simulator sim-1 exited" in told(*args)
    monkeypatch.setattr(run_loop, "run_training", lambda *a: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        main(list(args[:-1]) + [str(tmp_path / "cp2")])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_signal_stops_a_run_waiting_for_simulators_at_once_with_a_checkpoint(tmp_path, mode):
    """No simulator delivers (none connected, wait-s 0: wait for good): SIGTERM (a supervisor's stop) ends the
    run within moments, as a stop, with a checkpoint to resume from; it does not wait for an iteration that may
    never complete."""
    import signal
    import subprocess
    import time

    (tmp_path / "tree.json").write_text(json.dumps(TREE))
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "serve", "--external.tree",
                                str(tmp_path / "tree.json"), "--external.port", "0", "--external.wait-s", "0",
                                "--iterations", "1", "--mode", mode, "--no-progress", "--run-dir", str(run)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:  # serving
            if "waiting for external environments" in line:
                break
        deadline = time.monotonic() + 120
        while not (run / "config.json").exists():  # written as the training loop starts
            assert process.poll() is None and time.monotonic() < deadline, "the run never started training"
            time.sleep(0.1)
        time.sleep(3)  # the loop is in iteration 1's collection, waiting for data that will not come
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after iteration 0; continue with: shoal serve --resume" in err and "Traceback" not in err
    assert any((run / "checkpoints").glob("ckpt-000000*"))


@pytest.mark.parametrize("run_dir, ignored", [(True, False), (False, False), (False, True)])
def test_ctrl_c_while_waiting_for_the_first_simulator_ends_without_a_traceback(tmp_path, run_dir, ignored):
    """Before any simulator connected (no tree yet, nothing trained): Ctrl-C ends ``shoal serve`` with one line and
    exit 130, as every Ctrl-C the training loop does not handle itself; with or without ``--run-dir`` (without,
    the hint named a literal ``--run-dir RUN``), and when SIGINT came ignored (a script's background job: it was
    lost before training, and stopped the run once training had begun)."""
    import os
    import signal
    import subprocess

    root = str(Path(__file__).resolve().parents[2])
    process = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "serve", "--external.port", "0",
                                "--no-progress", *(["--run-dir", str(tmp_path / "run")] if run_dir else [])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": root},
                               preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None)
    try:
        for line in process.stderr:
            if "waiting for external environments" in line:
                break
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and "shoal serve: interrupted" in err and "Traceback" not in err, err
    # nothing was written: no resume hint (one that named the run dir sent the user to a run with no checkpoint)
    assert "shoal serve: interrupted before its first checkpoint: nothing to resume" in err, err


def test_sigterm_while_waiting_for_launched_simulators_stops_them_and_ends_in_one_line(tmp_path):
    """A supervisor's SIGTERM before any simulator connected (no training loop handles it yet) unwinds as Ctrl-C
    does: the launched simulators' process groups are killed, one line, exit 143; not a bare death that leaves
    them running."""
    import signal
    import subprocess

    marker = f"shoal-test-{tmp_path.name}"
    process = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "train", "--env", "external",
                                "--external.command", f"{sys.executable} -c 'import time; time.sleep(300)' {marker} {{port}}",
                                "--external.instances", "2", "--rollout.num-envs", "1", "--no-progress",
                                "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)

    def simulators() -> list[str]:
        out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        return [pid for pid in out.split() if int(pid) != process.pid]

    try:
        deadline = time.monotonic() + 60
        while len(simulators()) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert len(simulators()) == 2
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        subprocess.run(["pkill", "-f", marker])
    assert process.returncode == 143 and "shoal train: stopped by SIGTERM" in err and "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while simulators() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert simulators() == []


def test_a_run_without_data_says_what_the_server_turned_away():
    """A simulator with the wrong token (or one whose episodes never end: busy) reaches the server and is turned
    away: the run used to end with "is one running and pointed at this address?", and a launched one with "none
    of its starts connected: check external.command", though the server had refused them and knew why."""
    from types import SimpleNamespace

    from adapters.external.client import ExternalError, SimulatorClient
    from orchestration.external_fleet import ExternalFleet
    from orchestration.external_launcher import NoSimulatorData

    from core.specs import from_json

    server = ExternalServer(ExternalConfig(token="t"), from_json(json.dumps(TREE)), log=io.StringIO()).start()
    try:
        assert server.refusals() == ""
        for _ in range(2):
            with pytest.raises(ExternalError, match="bad_token"):
                SimulatorClient(server.url, "wrong", TREE, "sim")
        now = [0.0]
        fleet = ExternalFleet(server, None, SimpleNamespace(fragment_length=64), {}, wait_s=1, clock=lambda: now[0])
        now[0] = 2.0
        with pytest.raises(NoSimulatorData, match=r"no data from any external simulator for 1 s \(0 connected to "
                                                  r"ws://.*\): the server answered bad_token 2 times \(the "
                                                  r"simulators' token is not the run's, in run_dir/external_token"):
            fleet.pump()
        assert server.refusal_of("sim").startswith("the server refused sim with bad_token (the simulators' token")
        server.errors["unknown_episode"] = 5  # an episode's error, answered to a simulator let in: not a refusal
        assert "unknown_episode" not in server.refusals()
        assert server.refusals(since=dict(server.errors)) == ""  # none since (data came then): the old hint stays
    finally:
        server.close()


def test_a_launched_simulator_turned_away_is_said_to_be_turned_away(tmp_path, capsys):
    from orchestration.cli import main

    command = f"{sys.executable} {Path(__file__).resolve().parents[2] / 'examples' / 'external_sim.py'} " \
              "--port {port} --seed {seed} --sim-id {sim_id} --token wrong"
    with pytest.raises(SystemExit):
        main(["train", "--env", "external", "--external.command", command, "--external.max-restarts", "2",
              "--iterations", "1", "--no-progress", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "none of its last 3 starts was let in: the server refused sim-0.2 with bad_token (the simulators' token " \
           "is not the run's" in err, err


def test_a_signal_gives_up_a_collection_only_once_no_simulator_acts():
    """A slow simulator (a robot acting every second, completing no fragment for many seconds) is acting, not away:
    a signal does not throw its collection away; once nobody acts for the grace period, it does. (A small fake
    server: the test is about the fleet's rule; the signal end to end is the test above.)"""
    from types import SimpleNamespace

    from orchestration import external_fleet
    from orchestration.external_fleet import ExternalFleet
    from orchestration.fleet import CollectionInterrupted

    now = [0.0]
    server = SimpleNamespace(counters={"requests": 0, "uploaded_steps": 0}, connected={"robot"}, url="ws://test")
    fleet = ExternalFleet(server, None, SimpleNamespace(fragment_length=64), {}, wait_s=0, clock=lambda: now[0])
    fleet.pump()
    fleet.interrupt()
    for _ in range(10):  # 10 s of acting, no fragment: the collection goes on
        now[0] += 1.0
        server.counters["requests"] += 1
        fleet.pump()
    now[0] += external_fleet._INTERRUPT_GRACE_S * 0.9
    fleet.pump()  # silent, but within the grace
    now[0] += external_fleet._INTERRUPT_GRACE_S * 0.2
    with pytest.raises(CollectionInterrupted):
        fleet.pump()


def test_a_resumed_run_keeps_its_token_and_a_given_token_wins(tmp_path):
    """Simulators and robots configured with a run's token reconnect to the resumed run (the token is read back
    from the run's 0600 file; a token given by flag still wins)."""
    from orchestration.config import TrainConfig
    from orchestration.external_fleet import build_external

    (tmp_path / "tree.json").write_text(json.dumps(TREE))
    external = ExternalConfig(tree=str(tmp_path / "tree.json"))

    class Log(io.StringIO):  # what a script reading the file once it sees the waiting line would read
        read_at_line: list = []

        def write(self, text: str) -> int:
            if "waiting for external environments" in text:
                path = tmp_path / "run" / "external_token"
                self.read_at_line.append(path.read_text() if path.is_file() else "<missing>")
            return super().write(text)

    def token(**change) -> str:
        config = TrainConfig(env="external", run_dir=str(tmp_path / "run"), external=ExternalConfig(
            **{**{f: getattr(external, f) for f in ("tree",)}, **change}))
        fleet, _, _, teardown = build_external(config, log=Log())
        try:
            assert Log.read_at_line[-1] == fleet.server.token  # written whole before the line says it waits
            return fleet.server.token
        finally:
            fleet.close()
            if teardown is not None:
                teardown()

    first = token()
    assert token() == first == (tmp_path / "run" / "external_token").read_text()
    assert (tmp_path / "run" / "external_token").stat().st_mode & 0o777 == 0o600
    assert token(token="given") == "given"


def test_a_client_that_reaches_something_else_than_a_shoal_server_gets_an_external_error():
    """An HTTP server on the port (not WebSocket) gave websockets' InvalidMessage traceback, which neither the
    example simulator's ``except (OSError, ExternalError)`` nor a user's caught."""
    import threading
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from adapters.external.client import ExternalError, SimulatorClient

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    http = HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ExternalError, match=r"cannot connect to ws://127.0.0.1:\d+: it did not answer as a Shoal "
                                                r"server does .*check the host and port; a server with TLS is "
                                                r"reached with wss://") as info:
            SimulatorClient(f"ws://127.0.0.1:{http.server_address[1]}", "token", {"tree": {}}, timeout_s=5)
        assert info.value.code == "connect"
    finally:
        http.shutdown()
    with pytest.raises(ExternalError, match=r"'localhost:8765' is not a WebSocket address .*ws://host:port"):
        SimulatorClient("localhost:8765", "token", {"tree": {}}, timeout_s=5)


def test_a_server_waiting_for_its_first_simulator_says_how_long_it_waits(tmp_path, capsys):
    """Without a launcher or a given tree the run needs the first simulator's tree: the waiting line says how
    long it waits (``shoal serve`` for robots quit after 60 s with nothing said before), and the timeout names
    the flag."""
    from orchestration.builder import build_trainer
    from orchestration.config import TrainConfig

    config = TrainConfig(env="external", run_dir=str(tmp_path), external=ExternalConfig(start_timeout_s=0.3))
    with pytest.raises(TimeoutError, match=r"no simulator connected .* within 0.3 s.*--external.start-timeout-s"):
        build_trainer(config)
    assert "; the first must connect within 0.3 s (--external.start-timeout-s)" in capsys.readouterr().err


def test_a_run_writes_its_tree_and_a_resumed_run_refuses_a_simulator_with_another(tmp_path):
    """docs/external-protocol.md: the server writes run_dir/tree.json. A resumed run read it back: it adopted the
    first simulator's tree, a different one, and crashed loading the checkpoint's weights."""
    from adapters.external.client import ExternalError, SimulatorClient
    from orchestration.config import TrainConfig
    from orchestration.external_fleet import build_external

    (tmp_path / "given.json").write_text(json.dumps(TREE))
    first = TrainConfig(env="external", run_dir=str(tmp_path / "run"),
                        external=ExternalConfig(tree=str(tmp_path / "given.json"), token="t"))
    fleet, _, _, teardown = build_external(first, log=io.StringIO())
    fleet.close()
    assert json.loads((tmp_path / "run" / "tree.json").read_text()) == json.loads(json.dumps(TREE))
    resumed = TrainConfig(env="external", run_dir=str(tmp_path / "run"), external=ExternalConfig(token="t"))
    fleet, _, tree, teardown = build_external(resumed, log=io.StringIO())  # no simulator needed: the tree is known
    try:
        other = json.loads(json.dumps(TREE))
        other["tree"]["array"]["template"]["observation"]["shape"] = [5]
        with pytest.raises(ExternalError, match="spec_mismatch"):
            SimulatorClient(fleet.server.url, "t", other, "other")
    finally:
        fleet.close()
