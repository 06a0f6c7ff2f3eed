"""An external environment of several groups: each fragment's label is the oldest version that acted for each
group (and its policy), and a fragment in which one group never acted is still delivered."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import numpy as np
from websockets.sync.client import connect

from adapters.external.codec import TreeCodec
from adapters.external.messages import SERVER_TYPES, decode, encode
from core.layout import MASK
from core.policies import PolicyConfig, make_policies
from core.specs import default_policy_mapping, from_json
from orchestration.assignment import assign
from orchestration.config import ExternalConfig
from orchestration.external_episodes import Lanes
from orchestration.external_server import ExternalServer
from orchestration.inference import InferenceService

_OBS = {"leaf": "box", "shape": [2], "dtype": "float32", "low": "-inf", "high": "inf"}
_ACT = {"leaf": "discrete", "shape": [], "dtype": "int64", "n": 3, "start": 0}
TREE = {"format": "shoal.tree/1", "tree": {"population": {"members": {
    "red": {"agent": {"observation": _OBS, "action": _ACT}},
    "blue": {"agent": {"observation": {**_OBS, "shape": [3]}, "action": _ACT}}},
    "payoff": "general", "shared_observation": None}}}


@contextlib.contextmanager
def _served(tree_doc: dict, service, mapping=None):
    """``(connection after its welcome, delivered fragments)`` of a server recording fragments of 2 steps."""
    tree = from_json(json.dumps(tree_doc))
    delivered: list = []
    server = ExternalServer(ExternalConfig(token="secret", heartbeat_s=2.0, idle_timeout_s=10.0), tree,
                            log=io.StringIO()).start()
    server.attach(service, Lanes(TreeCodec(tree), assign(tree, mapping or {}), 2, lambda *i: delivered.append(i)))
    ws = connect(server.url, max_size=None, compression=None, proxy=None, legacy=True)
    try:
        ws.send(encode({"type": "hello", "protocol": 1, "token": "secret", "sim_id": "sim", "tree": tree_doc}))
        assert decode(ws.recv(timeout=10), max_bytes=1 << 30, allowed=SERVER_TYPES)["type"] == "welcome"
        yield ws, delivered
    finally:
        ws.close()
        server.close()
        service.close()


def _act(ws, i: int, group: str, width: int) -> dict:
    agents = {group: {"observation": np.zeros(width, np.float32)}}
    rewards = {"rewards": {group: 1.0}} if i else {}
    ws.send(encode({"type": "act", "id": i, "episode": "e", "agents": agents, **rewards}))
    answer = decode(ws.recv(timeout=10), max_bytes=1 << 30, allowed=SERVER_TYPES)
    assert answer["type"] == "actions", answer
    return answer


def test_a_group_that_never_acted_in_a_fragment_is_labelled_with_its_policys_version_not_a_dead_connection():
    """Only red asks for actions: the fragment used to fail to build (no version for blue) and the server closed
    the connection with a fatal 'internal' error. Now blue's masked entries carry its policy's version."""
    service = InferenceService(make_policies(from_json(json.dumps(TREE)), PolicyConfig())).start()
    service.set_weights("blue", 7, service.weights("blue"))
    with _served(TREE, service) as (ws, delivered):
        for i in range(5):
            assert _act(ws, i, "red", 2)["version"] == 0  # red's version acted
    fragment, meta, _ = delivered[0]
    assert meta["policy_versions"] == {"red": 0, "blue": 7}
    assert not fragment.get(("blue", MASK)).any() and fragment.get(("red", MASK)).all()


def test_in_turns_a_group_is_labelled_with_the_version_that_acted_for_it_not_one_of_a_step_it_sat_out():
    """Red, then blue: blue's v7 is published after the first step and blue acts only with it. Its label is 7
    (the review: filling its idle first step with v0 made it 0, and fresh data stale)."""
    service = InferenceService(make_policies(from_json(json.dumps(TREE)), PolicyConfig())).start()
    with _served(TREE, service) as (ws, delivered):
        for i, (group, width) in enumerate([("red", 2), ("blue", 3), ("red", 2), ("blue", 3)]):
            _act(ws, i, group, width)
            if i == 0:
                service.set_weights("blue", 7, service.weights("blue"))
    assert delivered[0][1]["policy_versions"] == {"red": 0, "blue": 7}


def test_groups_of_one_policy_label_it_with_the_oldest_version_that_acted_for_any_of_them():
    """Red and blue share policy p. Red acts with v0; blue sits out while the service reports v7 (a batch of
    another connection swapped it in). p's label is 0, not the 7 of blue's masked steps."""
    doc = copy.deepcopy(TREE)
    doc["tree"]["population"]["members"]["blue"]["agent"]["observation"]["shape"] = [2]
    tree = from_json(json.dumps(doc))
    service = InferenceService({"p": make_policies(tree, PolicyConfig())["red"]}).start()

    class Racy:  # the service, whose version moved on between the answer and the recording
        def __getattr__(self, name):
            return getattr(service, name)

        versions = {"p": 7}

    with _served(doc, Racy(), mapping={a: "p" for a in default_policy_mapping(tree)}) as (ws, delivered):
        for i in range(3):
            _act(ws, i, "red", 2)
    assert delivered[0][1]["policy_versions"] == {"p": 0}
