"""The conformance kit (adapters/external/conformance*.py) against the example simulator and broken ones.

Every broken simulator is one small script (``SIM`` below, written into ``tmp_path``) with one ``--fault``; the
same script without a fault passes, so each failure the tests expect comes from the fault and nothing else.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch

from adapters.external.conformance import Report, main, run_conformance
from adapters.external.conformance_actions import random_action
from adapters.external.conformance_checks import EpisodeState, check_act, check_end, parse_tree, value_problem
from adapters.external.messages import from_array
from core.specs import AgentNode, DictNode, DictPopulation, Leaf, tree_to_dict

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = (f"{sys.executable} {REPO / 'examples' / 'external_sim.py'} --port {{port}} --seed {{seed}} "
           f"--sim-id {{sim_id}} --token {{token}} --episodes 0")

# A simulator with 3 agents in an array: agents_0 plays every step, agents_1 joins at step 1, agents_2 plays steps
# 0-1 and leaves at step 2. Episodes are 4 steps, end alternately truncated (with final observations) and
# terminated; every act carries rewards and action masks. FAULT breaks one thing.
SIM = r'''
import itertools, sys, time
sys.path.insert(0, REPO)
import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
from adapters.external.messages import SERVER_TYPES, decode, encode, spec_hash, to_array

port, token, FAULT = sys.argv[1], sys.argv[2], sys.argv[3]
TREE = {"format": "shoal.tree/1", "tree": {"array": {"template": {
    "observation": {"dict": {"pos": {"leaf": "box", "shape": [2], "dtype": "float32", "low": "-inf", "high": "inf"},
                             "id": {"leaf": "box", "shape": [], "dtype": "int16", "low": 0, "high": 9}}},
    "action": {"leaf": "discrete", "shape": [], "dtype": "int64", "n": 3, "start": 0}},
    "capacity": 3, "payoff": "cooperative", "shared_observation": None}}}
URL = f"ws://127.0.0.1:{port}"
ws = connect(URL, open_timeout=10, max_size=None, compression=None, ping_interval=None, proxy=None, legacy=True)
def send(message):
    ws.send(encode(message))
def recv():
    return decode(ws.recv(timeout=10), max_bytes=1 << 30, allowed=SERVER_TYPES)
hello = {"type": "hello", "protocol": 1, "token": token, "sim_id": "test-sim", "tree": TREE,
         "spec_hash": "0" * 64 if FAULT == "wrong_hash" else spec_hash(TREE)}
if FAULT == "no_hello":
    send({"type": "act", "id": 0, "episode": "e", "agents": {}})
send(hello)
welcome = recv()
if welcome["type"] == "error":  # the wrong-token launch
    if FAULT == "hang_on_bad_token":
        time.sleep(60)
    if FAULT in ("reconnect_loop", "retry_twice"):
        for _ in range(200 if FAULT == "reconnect_loop" else 2):
            try:
                with connect(URL, open_timeout=10, proxy=None) as again:
                    again.send(encode(hello))
                    again.recv(timeout=10)
            except Exception:
                pass
    sys.exit(2)
ids = itertools.count()
def obs(i, step):
    return {"pos": np.array([i, step], np.float32), "id": np.array(i, np.int16)}
def entry(i, step):
    return {"observation": obs(i, step), "action_mask": np.array([True, True, i != 1])}
def episode(name, k):
    left, rewards = {}, {}
    for step in range(4):
        agents = {f"agents_{i}": entry(i, step) for i in range(3) if (i == 0 or (i == 1 and step >= 1)
                                                                      or (i == 2 and step < 2))}
        if k == 1 and step == 2:
            if FAULT == "unknown_agent":
                agents["agents_7"] = entry(0, step)
            if FAULT == "obs_shape":
                agents["agents_0"]["observation"]["pos"] = np.zeros(3, np.float32)
            if FAULT == "obs_dtype":
                agents["agents_0"]["observation"]["id"] = np.array(1.5, np.float32)
            if FAULT == "bad_mask":
                agents["agents_0"]["action_mask"] = np.array([True, True])
            if FAULT == "bad_left":
                left = {"agents_2": "gone"}
        if k == 1 and step == 3 and FAULT == "comes_back":
            agents["agents_2"] = entry(2, step)
        if k == 1 and step == 1 and FAULT == "text_frame":
            ws.send("{\"type\": \"act\"}")
        message = {"type": "act", "id": next(ids), "episode": name, "agents": agents, "rewards": rewards}
        if left:
            message["left"] = left
        send(message)
        if k == 1 and step == 1 and FAULT == "two_outstanding":
            send(dict(message, id=next(ids)))
            recv()
        answer = recv()
        if answer["type"] == "error":
            if answer["fatal"] or FAULT == "stop_on_error":
                sys.exit(3)
            if FAULT == "ignore_error":
                send(dict(message, id=next(ids)))
                recv()
            return
        assert set(answer["actions"]) == set(agents), answer
        for agent, action in answer["actions"].items():  # int64 [] and legal under the mask
            value = to_array(action, agent)
            assert value.dtype == np.int64 and value.shape == () and agents[agent]["action_mask"][value], answer
        rewards = {a: 1.0 for a in answer["actions"]}
        left = {"agents_2": "terminated"} if step == 1 else {}
    if FAULT == "no_end" and k % 2 == 0:  # abandoned: never ended
        return
    end = {"type": "end", "episode": name, "outcome": "truncated" if k % 2 == 0 else "terminated", "rewards": rewards}
    if k % 2 == 0:
        end["observations"] = {"agents_0": obs(0, 4)}
    send(end)
send({"type": "ping", "t": 7})
pong = recv()
assert pong == {"type": "pong", "t": 7}, pong
if FAULT == "end_unknown":
    send({"type": "end", "episode": "never-started", "outcome": "terminated"})
    recv()
def connect_again():  # refused with busy: the kit checks one connection per simulator
    with connect(URL, open_timeout=10, proxy=None) as again:
        again.send(encode(hello))
        again.recv(timeout=10)
if FAULT == "second_connection":
    connect_again()
try:
    for k in itertools.count():
        episode("e1" if FAULT == "reuse_episode" and k == 2 else f"e{k}", k)
except ConnectionClosed:
    if FAULT == "connect_after_close":
        connect_again()
    sys.exit(0)
'''


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sims") / "sim.py"
    path.write_text(f"REPO = {str(REPO)!r}\n" + SIM)
    return str(path)


def check(sim: str, fault: str, **kw) -> Report:
    kw = {"episodes": 3, "timeout_s": 10.0, "check_token": False, **kw}
    return run_conformance(f"{sys.executable} {sim} {{port}} {{token}} {fault}", **kw)


def failures(report: Report) -> str:
    return "\n".join(report.failures)


def test_the_example_simulator_conforms():
    report = run_conformance(EXAMPLE, episodes=5, timeout_s=20.0)
    assert report.ok, report.format()
    assert report.episodes >= 5 and report.acts > 20
    assert report.joined > 0 and report.left > 0  # the example's agents come and go
    assert any("no action_mask sent" in w for w in report.warnings)  # it never sends masks
    assert any(n.startswith("main launch: exit code 0") for n in report.notes)  # it exits cleanly when closed
    assert any("wrong-token launch: 1 connection(s), exit code" in n for n in report.notes)


def test_the_example_simulator_acting_with_its_own_policy_conforms():
    """Local-policy mode: the kit answers get_policy with a fresh policy of the tree (version 0) and checks the
    uploads by the server's parser; the example fetches it, acts and uploads whole episodes."""
    report = run_conformance(EXAMPLE + " --local-policy 2", episodes=3, timeout_s=20.0, check_token=False)
    assert report.ok, report.format()
    assert report.episodes >= 3 and report.acts == 0 and report.uploaded > 3
    assert [w for w in report.warnings if "local-policy mode" in w], report.format()


def test_an_upload_with_a_version_never_published_fails():
    from adapters.external.conformance_uploads import check_trajectory

    kit_tree, _ = parse_tree(TREE_DOC)
    step = {"agents": {"agents_0": {"observation": {"pos": from_array(np.zeros(2, np.float32)), "id": 1},
                                    "action": 2, "log_prob": -1.1}}}
    checked, steps, _ = check_trajectory({"versions": {"agents": 0}, "steps": [step, step]}, kit_tree, "t",
                                         EpisodeState())
    assert not checked.failures and steps == 2
    checked, steps, _ = check_trajectory({"versions": {"agents": 3}, "steps": [step]}, kit_tree, "t", EpisodeState())
    assert "the kit published version 0 only" in checked.failures[0][1] and steps == 0  # refused whole
    illegal = {"agents": {"agents_0": dict(step["agents"]["agents_0"], action=5)}}
    checked, steps, _ = check_trajectory({"versions": {"agents": 0}, "steps": [step, illegal]}, kit_tree, "t",
                                         EpisodeState())
    assert steps == 1 and "outside its discrete space" in checked.failures[0][1] and checked.fatal is None


def test_uploads_keep_the_join_and_leave_rules_across_steps_and_uploads():
    """An uploaded episode is held to what acts are: an agent leaves once, after it joined, and does not come
    back; joins and leaves are counted for the report (a second leave passed, and the report said 0 and 0)."""
    from adapters.external.conformance_uploads import check_trajectory

    kit_tree, _ = parse_tree(TREE_DOC)
    names = [name for name in kit_tree.agents][:2]

    def entry():
        return {"observation": {"pos": from_array(np.zeros(2, np.float32)), "id": 1}, "action": 2, "log_prob": -1.1}

    first, both = {"agents": {names[0]: entry()}}, {"agents": {names[0]: entry(), names[1]: entry()}}
    leaves = {"agents": {names[0]: entry()}, "left": {names[1]: "terminated"}}
    episode = EpisodeState()
    checked, steps, joined = check_trajectory({"versions": {"agents": 0}, "steps": [first, both, leaves]}, kit_tree,
                                              "t", episode)
    assert not checked.failures and (steps, joined, checked.left) == (3, 1, {names[1]})
    checked, steps, _ = check_trajectory({"versions": {"agents": 0}, "steps": [leaves]}, kit_tree, "t", episode)
    assert steps == 0 and f"agent {names[1]!r} left this episode a second time" in checked.failures[0][1]
    checked, steps, _ = check_trajectory({"versions": {"agents": 0}, "steps": [both]}, kit_tree, "t", episode)
    assert steps == 0 and "comes back" in checked.failures[0][1]


def test_the_test_simulator_conforms_and_covers_everything_but_pipelining(sim):
    report = check(sim, "none", check_token=True)
    assert report.ok, report.format()
    assert report.episodes >= 3 and report.joined >= 1 and report.left >= 1
    assert [w for w in report.warnings if "pipelining" not in w] == [], report.format()


@pytest.mark.parametrize("fault, expected", [
    ("unknown_agent", "agent 'agents_7' is not in the tree"),
    ("obs_shape", "observation of agents_0/pos: shape [3], the tree says [2]"),
    ("obs_dtype", "observation of agents_0/id: dtype float32 does not convert without loss to the tree's int16"),
    ("bad_mask", "action_mask of agents_0: shape [2]; the action has n=3 choices"),
    ("bad_left", "left['agents_2'] is 'gone'"),
    ("comes_back", "agent 'agents_2' left this episode and comes back"),
    ("reuse_episode", "episode 'e1' reused: it ended (by its end message)"),
    ("ignore_error", "episode 'e0' reused: the kit's non-fatal error ended it"),
    ("stop_on_error", "after the kit's non-fatal error for episode 'e0'"),
    ("two_outstanding", "of this episode is still unanswered"),
    ("text_frame", "text frame: every message is a binary frame"),
    ("end_unknown", "end for episode 'never-started', which never started"),
    ("wrong_hash", "spec_hash '0000"),
    ("no_hello", "the first message must be a hello"),
])
def test_a_broken_simulator_gets_its_failure_named(sim, fault, expected):
    report = check(sim, fault)
    assert not report.ok
    assert expected in failures(report), report.format()
    if fault == "wrong_hash":  # refused in the hello as the server refuses it (the kit welcomed it and played on)
        assert report.acts == 0, report.format()


def test_episodes_that_never_end_fail_by_name(sim):
    """A simulator that abandons episodes (no 'end') passed the kit, which closed before its open episodes mattered;
    a real server counts them open and, past max_episodes, refuses new ones with busy: no data ever trained."""
    report = check(sim, "no_end", episodes=12)
    assert not report.ok and "episode(s) never ended: no act over the connection's last 64 acts (the first: 'e2'), " \
                             "and no 'end'" in failures(report), report.format()


def test_an_agent_that_stops_asking_without_leaving_is_a_warning_at_its_episodes_end():
    tree, _ = parse_tree(TREE_DOC)
    quiet = EpisodeState(seen={"agents_0", "agents_1"}, acts=20, last={"agents_0": 20, "agents_1": 3})
    checked = check_end({"type": "end", "episode": "e", "outcome": "terminated"}, tree, quiet)
    assert not checked.failures and [k for k, _ in checked.warnings] == ["agent.silent"]
    assert "'agents_1' had no decision in the episode's last 8 acts" in checked.warnings[0][1]
    quiet.gone.add("agents_1")  # left through 'left': nothing to say
    assert check_end({"type": "end", "episode": "e", "outcome": "terminated"}, tree, quiet).warnings == []


@pytest.mark.parametrize("fault, expected", [
    ("second_connection", "opened 1 more connection while its first was open"),
    ("connect_after_close", "connected again 1 time after its first connection closed"),
])
def test_more_connections_are_told_as_they_happened(sim, fault, expected):
    report = check(sim, fault)
    assert report.ok and [w for w in report.warnings if "connect" in w and expected in w], report.format()
    assert report.episodes > 1 and f"{report.episodes} episodes ended, {report.acts} acts" in report.format()


def test_each_finding_names_the_message_that_showed_it(sim):
    report = check(sim, "unknown_agent")
    (finding,) = [f for f in report.failures if "agents_7" in f]
    assert finding.startswith("message #") and "(act id=" in finding and "episode='e1'" in finding, finding


def test_a_simulator_that_hangs_after_a_refused_token_fails(sim):
    # 5 s, not less: the same limit is the wait for the simulator to start and connect, which a loaded CI
    # machine (pytest -n 2 beside subprocesses) can stretch past 2 s
    report = check(sim, "hang_on_bad_token", check_token=True, timeout_s=5.0)
    assert "still running 5 s after a fatal bad_token error" in failures(report), report.format()


@pytest.mark.parametrize("fault", ["reconnect_loop", "retry_twice"])
def test_a_simulator_that_reconnects_after_a_refused_token_fails(sim, fault):
    """The page says: exit without reconnecting (the token will not change); a few retries fail too."""
    report = check(sim, fault, check_token=True)
    assert "after a fatal bad_token error the simulator reconnected" in failures(report), report.format()


def test_a_command_that_cannot_start_fails():
    report = run_conformance("/nonexistent/simulator --port {port}", timeout_s=2.0, check_token=False)
    assert "cannot start the command" in failures(report)


def test_a_misspelt_placeholder_is_a_usage_error_named_as_shoal_train_names_it(capsys):
    """The kit takes the template ``shoal train --external.command`` takes: one renderer, the same refusals, and,
    as there, a fault of the command line (exit code 2, one paragraph), not a finding about the simulator."""
    with pytest.raises(ValueError, match=r"--command argument '\{prot\}': unknown placeholder 'prot'"):
        run_conformance(f"{sys.executable} -c pass --port {{prot}}", timeout_s=2.0, check_token=False)
    assert main(["--command", f"{sys.executable} -c pass --port {{prot}}"]) == 2
    err = capsys.readouterr().err
    assert "shoal conformance: --command argument '{prot}': unknown placeholder 'prot'; the placeholders are {host}" \
        in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and "FAILED" not in err


def test_main_prints_the_report_and_returns_the_verdict(sim, capsys):
    ok = main(["--command", f"{sys.executable} {sim} {{port}} {{token}} none", "--episodes", "2", "--timeout-s", "10"])
    assert ok == 0 and "shoal conformance: PASSED" in capsys.readouterr().out
    bad = main(["--command", f"{sys.executable} {sim} {{port}} {{token}} bad_left", "--episodes", "2",
                "--timeout-s", "10", "--no-token-check"])
    assert bad == 1 and "shoal conformance: FAILED" in capsys.readouterr().out


def test_values_are_judged_by_the_servers_rule():
    def fits(value, leaf):
        return value_problem(value, leaf, "x") is None

    f32, i64, i16 = Leaf.box(()), Leaf.box((), dtype=torch.int64), Leaf.box((), dtype=torch.int16)
    wire = lambda a: from_array(np.asarray(a))  # noqa: E731 - an array map, as decoded off the wire
    assert fits(wire(np.int32(3)), i64) and fits(wire(np.float64(0.5)), f32) and fits(wire(np.float16(1)), f32)
    assert not fits(wire(np.int64(3)), Leaf.box((), dtype=torch.int32)) and not fits(wire(np.float32(1)), i64)
    assert fits(3, i16) and not fits(70000, i16) and fits(2, f32) and fits(2.0, i64) and not fits(0.5, i64)
    assert fits(wire(np.float32(1)), Leaf.box((), dtype=torch.bfloat16))  # a bfloat16 leaf travels as a float
    assert "NaN or infinity" in value_problem(float("nan"), f32, "x")
    assert "NaN or infinity" in value_problem(wire(np.array([1, np.inf], np.float32)), Leaf.box((2,)), "x")
    assert "shape [], the tree says [2]" in value_problem(3, Leaf.box((2,)), "x")
    assert "does not fit" in value_problem(2**64 - 1, i64, "x")
    assert "expected a map with keys ['a']" in value_problem({"b": wire(np.zeros(2, np.float32))},
                                                             DictNode({"a": Leaf.box((2,))}), "x")


TREE_DOC = {"format": "shoal.tree/1", "tree": {"array": {"template": {
    "observation": {"dict": {"pos": {"leaf": "box", "shape": [2], "dtype": "float32", "low": "-inf", "high": "inf"},
                             "id": {"leaf": "box", "shape": [], "dtype": "int16", "low": 0, "high": 9}}},
    "action": {"leaf": "discrete", "shape": [], "dtype": "int64", "n": 3, "start": 0}},
    "capacity": 3, "payoff": "cooperative", "shared_observation": None}}}
"""The test simulator's tree (``SIM``)."""


def test_a_malformed_array_is_fatal_as_on_the_server_and_a_nan_is_not():
    """The kit answers what the server answers: its parser's fatal ``bad_message`` closes the connection; a
    value that parses but breaks the tree (NaN) is a non-fatal ``spec_violation``."""
    kit_tree, problems = parse_tree(TREE_DOC)
    assert not problems
    malformed = {"dtype": "float32", "shape": [2], "data": b"12345"}  # 5 bytes where float32 [2] needs 8
    checked = check_act({"agents": {"agents_0": {"observation": {"pos": malformed, "id": 1}}}}, kit_tree,
                        EpisodeState())
    assert checked.fatal is not None and checked.fatal[0] == "bad_message" and "expected 8" in checked.fatal[1]
    nan = from_array(np.array([np.nan, 0], np.float32))
    checked = check_act({"agents": {"agents_0": {"observation": {"pos": nan, "id": 1}}}}, kit_tree, EpisodeState())
    assert checked.fatal is None and "NaN or infinity" in checked.failures[0][1]


def test_trees_the_server_does_not_serve_are_refused():
    agent = AgentNode(observation=Leaf.box((2,)), action=Leaf.discrete(3))
    nested = DictPopulation(members={"team": DictPopulation(members={"a": agent}, shared_observation=Leaf.box((4,)))})
    tree, problems = parse_tree({"format": "shoal.tree/1", "tree": tree_to_dict(nested)})
    assert tree is None and "shared observation on the root population only" in problems[0]
    twice = DictPopulation(members={"x": agent, "sub": DictPopulation(members={"x": agent})})
    tree, problems = parse_tree({"format": "shoal.tree/1", "tree": tree_to_dict(twice)})
    assert tree is None and "sub/x: agent name 'x' is also in group 'x'" in problems[0]
    tree, problems = parse_tree(tree_to_dict(agent))  # a bare single agent: wrapped, one agent named 'agent'
    assert tree is not None and list(tree.agents) == ["agent"] and "bare tree" in problems[0]


def test_random_actions_are_legal():
    rng = np.random.default_rng(0)
    leaves = [Leaf.box((3,), low=-1, high=(0, 1, 2)), Leaf.box((2,), low=0, dtype=torch.int16),
              Leaf.box((), dtype=torch.bfloat16), Leaf.multi_discrete((2, 5)), Leaf.binary(4, dtype=torch.bool)]
    for leaf in leaves:
        for _ in range(20):
            assert value_problem(from_array(random_action(leaf, rng)), leaf, "x") is None
    assert {int(random_action(Leaf.discrete(4, start=1), rng, np.array([0, 1, 0, 1], bool))) for _ in range(40)} \
        == {2, 4}


def test_an_end_without_an_outcome_is_said_to_be_missing():
    """A gym-style ``end`` (``terminated: true``, no ``outcome``) read "'outcome' is None"."""
    from adapters.external.conformance_checks import check_end

    kit_tree, _ = parse_tree(TREE_DOC)
    checked = check_end({"type": "end", "episode": "e", "terminated": True}, kit_tree, EpisodeState())
    assert checked.failures[0] == ("end.outcome", "'outcome' is missing; it must be 'terminated' or 'truncated'")
    checked = check_end({"type": "end", "episode": "e", "outcome": "done"}, kit_tree, EpisodeState())
    assert checked.failures[0][1].startswith("'outcome' is 'done'")
