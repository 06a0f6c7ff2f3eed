"""How the external server ends a connection it will not keep (``orchestration.external_endings``): silence is
told in the close frame and on the log, and counted."""

from __future__ import annotations

import io
import json
import subprocess

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from adapters.external.codec import TreeCodec
from adapters.external.messages import encode
from core.policies import PolicyConfig, make_policies
from core.specs import from_json
from orchestration.assignment import assign
from orchestration.config import ExternalConfig
from orchestration.external_episodes import Lanes
from orchestration.external_launcher import render
from orchestration.external_server import ExternalServer
from orchestration.inference import InferenceService

from .test_external_server import SIM, TREE, _wait


def _closing_frame(ws):
    """The close frame the server sent (reading until the connection closes)."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=10)
    return closed.value.rcvd


def test_silent_connections_are_closed_with_the_reason_and_logged():
    """No hello within heartbeat_s, or no message for idle_timeout_s: close code 1008 with the reason (a
    plain 1000 "OK" told the simulator nothing), a line on the server's log, and a counter."""
    tree = from_json(json.dumps(TREE))
    service = InferenceService({"agents": make_policies(tree, PolicyConfig())["agents"]}).start()
    log = io.StringIO()
    server = ExternalServer(ExternalConfig(token="secret", heartbeat_s=0.5, idle_timeout_s=1.0), tree, log=log).start()
    server.attach(service, Lanes(TreeCodec(tree), assign(tree, {}), 4, lambda *item: None))
    try:
        silent = connect(server.url, proxy=None, legacy=True)
        frame = _closing_frame(silent)
        assert (frame.code, frame.reason) == (1008, "no hello within 0.5 s (heartbeat_s) of connecting")
        idle = connect(server.url, proxy=None, legacy=True)
        idle.send(encode({"type": "hello", "protocol": 1, "token": "secret", "sim_id": "quiet", "tree": TREE}))
        frame = _closing_frame(idle)  # the welcome, then nothing from the simulator for a second
        assert (frame.code, frame.reason) == (1008, "no message for 1 s (idle_timeout_s)")
    finally:
        server.close()
        service.close()
    assert server.counters["idle_closed"] == 2
    told = log.getvalue()
    assert "closed: no hello within 0.5 s (heartbeat_s) of connecting" in told
    assert "connection of sim id 'quiet' closed: no message for 1 s (idle_timeout_s)" in told


def test_connections_lost_while_the_run_ends_are_counted_not_told():
    """The launcher stops its simulators when the run ends: those lost connections cut their episodes (counted)
    but are not told on the log as the simulators' failures (every run's end read like a crash)."""
    tree = from_json(json.dumps(TREE))
    service = InferenceService({"agents": make_policies(tree, PolicyConfig())["agents"]}).start()
    log = io.StringIO()
    server = ExternalServer(ExternalConfig(token="secret"), tree, log=log).start()
    lanes = Lanes(TreeCodec(tree), assign(tree, {}), 4, lambda *item: None)
    server.attach(service, lanes)
    procs = []
    try:
        for ending in (False, True):
            args = render(SIM, host="127.0.0.1", port=server.port, seed=0, sim_id=f"ending-{ending}", token="secret")
            procs.append(proc := subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait(lambda: lanes.counters["steps_recorded"] > 5 and f"ending-{ending}" in server.connected)
            if ending:
                server.ending()
            proc.kill()
            _wait(lambda: f"ending-{ending}" not in server.connected, timeout=10)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        server.close()
        service.close()
    told = log.getvalue()
    assert "sim id 'ending-False' lost: it dropped without a close frame" in told  # a crash: told
    assert "ending-True" not in told and lanes.counters["episodes_cut"] >= 1, told  # the run's end: counted only


def test_an_end_and_a_bye_sent_just_before_the_close_are_served_not_cut(served_for_endings):
    """A simulator that ends its last episode and closes at once: the end and the bye arrived with the close, and
    reading past them raised, so the episode was cut (and its final rewards lost) in about half of such runs."""
    server, lanes = served_for_endings
    obs = np.zeros(4, np.float32)
    for k in range(12):
        ws = connect(server.url, proxy=None, legacy=True)
        ws.send(encode({"type": "hello", "protocol": 1, "token": "secret", "sim_id": f"s{k}", "tree": TREE}))
        ws.recv(timeout=10)  # the welcome
        ws.send(encode({"type": "act", "id": 0, "episode": "e", "agents": {"agents_0": {"observation": obs}}}))
        ws.recv(timeout=10)  # the actions
        ws.send(encode({"type": "end", "episode": "e", "outcome": "terminated", "rewards": {"agents_0": 1.0}}))
        ws.send(encode({"type": "bye"}))
        ws.close()
    _wait(lambda: lanes.counters["episodes_completed"] + lanes.counters["episodes_cut"] == 12)
    assert (lanes.counters["episodes_completed"], lanes.counters["episodes_cut"]) == (12, 0)


@pytest.fixture
def served_for_endings():
    tree = from_json(json.dumps(TREE))
    service = InferenceService({"agents": make_policies(tree, PolicyConfig())["agents"]}).start()
    lanes = Lanes(TreeCodec(tree), assign(tree, {}), 4, lambda *item: None)
    server = ExternalServer(ExternalConfig(token="secret"), tree, log=io.StringIO()).start()
    server.attach(service, lanes)
    yield server, lanes
    server.close()
    service.close()
