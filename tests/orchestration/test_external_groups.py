"""An external environment of several groups: a fragment in which one group never acted is still delivered."""

from __future__ import annotations

import io
import json

import numpy as np
from websockets.sync.client import connect

from adapters.external.codec import TreeCodec
from adapters.external.messages import SERVER_TYPES, decode, encode
from core.layout import MASK
from core.policies import PolicyConfig, make_policies
from core.specs import from_json
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


def test_a_group_that_never_acted_in_a_fragment_is_labelled_with_its_policys_version_not_a_dead_connection():
    """Only red asks for actions: the fragment used to fail to build (no version for blue) and the server closed
    the connection with a fatal 'internal' error. Now blue's masked entries carry its policy's version."""
    tree = from_json(json.dumps(TREE))
    service = InferenceService(make_policies(tree, PolicyConfig())).start()
    service.set_weights("blue", 7, service.weights("blue"))
    delivered: list = []
    server = ExternalServer(ExternalConfig(token="secret", heartbeat_s=2.0, idle_timeout_s=10.0), tree,
                            log=io.StringIO()).start()
    server.attach(service, Lanes(TreeCodec(tree), assign(tree, {}), 2, lambda *item: delivered.append(item)))
    ws = connect(server.url, max_size=None, compression=None, proxy=None, legacy=True)
    try:
        ws.send(encode({"type": "hello", "protocol": 1, "token": "secret", "sim_id": "red-only", "tree": TREE}))
        assert decode(ws.recv(timeout=10), max_bytes=1 << 30, allowed=SERVER_TYPES)["type"] == "welcome"
        for i in range(5):
            red = {"red": {"observation": np.full(2, i, np.float32)}}
            ws.send(encode({"type": "act", "id": i, "episode": "e", "agents": red,
                            **({"rewards": {"red": 1.0}} if i else {})}))
            answer = decode(ws.recv(timeout=10), max_bytes=1 << 30, allowed=SERVER_TYPES)
            assert answer["type"] == "actions" and answer["version"] == 0, answer  # red's version acted
    finally:
        ws.close()
        server.close()
        service.close()
    fragment, meta, _ = delivered[0]
    assert meta["policy_versions"] == {"red": 0, "blue": 7}
    assert not fragment.get(("blue", MASK)).any() and fragment.get(("red", MASK)).all()
