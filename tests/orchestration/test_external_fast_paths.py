"""The external act path's shortcuts give what the general paths give (differential tests):

- ``action_maps`` encodes actions as ``action_value`` did, one numpy view per group;
- ``TreeCodec`` reads a plain array map of exactly a leaf's dtype and shape without :func:`parse_value`;
- ``InferenceService.serve_alone`` serves a lone request without the queue;
- ``Episode.consequences`` skips ``where_slots`` when no agent of the open step fell silent.

Each shortcut can be switched off (``codec._plain = {}``, ``serve_alone`` answering None, ``consequences`` as
it was before), which gives the general path as the reference.
"""

from __future__ import annotations

import io
import json

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adapters.external.client import SimulatorClient
from adapters.external.codec import TreeCodec, action_maps, action_value, where_slots
from adapters.external.messages import DTYPES, ProtocolError, decode, encode
from core.layout import DONE, MASK, OBSERVATION, REWARD, TERMINATED, TRUNCATED
from core.policies import PolicyConfig, make_policies
from core.specs import from_json
from orchestration.assignment import assign
from orchestration.config import ExternalConfig
from orchestration.external_episodes import Episode, Lanes
from orchestration.external_server import ExternalServer
from orchestration.inference import InferenceConfig, InferenceService

TREE = {"format": "shoal.tree/1", "tree": {"array": {
    "template": {"observation": {"leaf": "box", "shape": [2, 3], "dtype": "float32", "low": "-inf", "high": "inf"},
                 "action": {"leaf": "discrete", "shape": [], "dtype": "int64", "n": 4, "start": 0}},
    "capacity": 3, "payoff": "cooperative", "shared_observation": None}}}
AGENTS = ("agents_0", "agents_1", "agents_2")


# -- the codec --------------------------------------------------------------------------------------------------
def _parse(codec: TreeCodec, message: dict):
    try:
        r = codec.parse_act(message, "act")
    except ProtocolError as error:
        return ("error", error.code, str(error))
    return ("ok", {g: o.tolist() for g, o in r.observation.items()}, {g: m.tolist() for g, m in r.mask.items()},
            r.agents, {g: [t.tolist() for t in v] for g, v in r.left.items()})


values = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-3, 300))
array_maps = st.fixed_dictionaries({
    "dtype": st.sampled_from([*DTYPES, "float32", "float32", "complex64", 3]),
    "shape": st.sampled_from([[2, 3], [2, 3], [3, 2], [6], [2.0, 3], [True, 3], [2, 3, 1], "2,3", []]),
    "data": st.one_of(st.binary(max_size=48), st.lists(values, min_size=6, max_size=6).map(
        lambda xs: np.asarray(xs, np.float32).tobytes()), st.just("text"))})


@given(observation=st.one_of(array_maps, values, st.just({"x": 1})),
       left=st.sampled_from([None, {"agents_2": "terminated"}, {"agents_2": "truncated"}, {"agents_2": "gone"}]))
def test_plain_observations_parse_as_the_full_check_parses_them(observation, left):
    tree = from_json(json.dumps(TREE))
    fast, full = TreeCodec(tree), TreeCodec(tree)
    full._plain = {}
    message = {"type": "act", "id": 1, "episode": "e", "agents": {"agents_1": {"observation": observation}}}
    if left is not None:
        message["left"] = left
    message = decode(msgpack.packb(message, use_bin_type=True), max_bytes=1 << 20)
    assert fast._plain and _parse(fast, message) == _parse(full, message)


# -- the inference service ---------------------------------------------------------------------------------------
def _policy():
    torch.manual_seed(0)
    return make_policies(from_json(json.dumps(TREE)), PolicyConfig())["agents"]


def test_serve_alone_gives_what_the_queue_gives():
    policy = _policy()
    a = InferenceService({"agents": policy}, InferenceConfig(max_wait_s=0.0, seed=3)).start()
    b = InferenceService({"agents": policy}, InferenceConfig(max_wait_s=0.0, seed=3))  # not started: only its queue
    generator = torch.Generator().manual_seed(1)
    try:
        for i in range(12):
            obs = {"observation": torch.randn(1, 3, 2, 3, generator=generator),
                   "mask": torch.rand(1, 3, generator=generator) < 0.7}
            deterministic = i % 3 == 0
            answer = a.serve_alone("agents", obs, deterministic=deterministic)
            assert answer is not None  # an idle service with one caller serves it at once
            future = b.submit("agents", obs, deterministic=deterministic)
            assert b.serve_queued()
            got, want = answer.result(), future.result()
            assert torch.equal(got.action, want.action) and torch.equal(got.log_prob, want.log_prob)
            assert (got.version, got.batch) == (want.version, want.batch)
        assert a.stats() == b.stats()
        queued = a.submit("agents", obs)  # someone is queued: the caller must not overtake them
        assert a.serve_alone("agents", obs) is None
        queued.result(timeout=60)
    finally:
        a.close()
        b.close()


# -- the server, end to end --------------------------------------------------------------------------------------
def _reference_consequences(self, request) -> None:
    """``Episode.consequences`` as it was before its shortcut: ``where_slots`` and the count on every step."""
    if self.open is None:
        return
    nxt, approx = {}, 0
    for g, (term, trunc, _) in request.left.items():
        entry = self.open[g]
        was, now = entry[MASK], request.mask[g]
        approx += int((was & ~now & ~term.squeeze(-1)).sum())
        nxt[g] = {OBSERVATION: where_slots(now, request.observation[g], entry[OBSERVATION]),
                  REWARD: request.reward[g], TERMINATED: term, TRUNCATED: trunc, DONE: term | trunc, MASK: was}
    if approx:
        self.lanes.count("approx_bootstraps", approx)
    self._complete(nxt, request.shared, False, False)


SCRIPT = [  # (agents asking, rewards, left): agents join, fall silent, come back and leave
    (("agents_0", "agents_1"), None, None),
    (("agents_0",), {"agents_0": 0.5, "agents_1": 0.25}, None),
    (("agents_0", "agents_1", "agents_2"), {"agents_0": 1.0}, None),
    (("agents_0", "agents_2"), {"agents_1": 2.0}, {"agents_1": "terminated"}),
    (("agents_2",), None, {"agents_0": "truncated"}),
    (("agents_1", "agents_2"), {"agents_2": -1.0}, None),
]


def _run_script(monkeypatch, general: bool):
    tree = from_json(json.dumps(TREE))
    with monkeypatch.context() as patch:
        if general:
            patch.setattr(InferenceService, "serve_alone", lambda self, *a, **k: None)
            patch.setattr(Episode, "consequences", _reference_consequences)
        service = InferenceService({"agents": _policy()}, InferenceConfig(max_wait_s=0.0, seed=5)).start()
        out: list = []
        codec = TreeCodec(tree)
        if general:
            codec._plain = {}
        lanes = Lanes(codec, assign(tree, {}), 5, lambda *item: out.append(item))
        server = ExternalServer(ExternalConfig(token="t"), tree, log=io.StringIO()).start()
        server.attach(service, lanes)
        client = SimulatorClient(server.url, "t", TREE, "sim")
        rng = np.random.default_rng(0)
        answers = []
        try:
            for episode in ("a", "b"):
                for asking, rewards, left in SCRIPT:
                    agents = {n: rng.normal(size=(2, 3)).astype(np.float32) for n in asking}
                    answer = client.act(episode, agents, rewards=rewards, left=left)
                    answers.append((answer.version, {k: v.tolist() for k, v in answer.actions.items()}))
                client.end(episode, "truncated", rewards={"agents_1": 3.0},
                           observations={"agents_2": np.ones((2, 3), np.float32)})
            client.ping()  # the server read every frame before: nothing is cut by closing
            client.close()
        finally:
            server.close()
            service.close()
        served = service.stats()["served"]
    return answers, out, dict(lanes.counters), served


def test_the_server_records_the_same_fragments_with_or_without_its_shortcuts(monkeypatch):
    fast_answers, fast_out, fast_counters, fast_served = _run_script(monkeypatch, general=False)
    answers, out, counters, served = _run_script(monkeypatch, general=True)
    assert fast_answers == answers and fast_counters == counters and fast_served == served == len(answers)
    assert counters["approx_bootstraps"] > 0 and counters["steps_recorded"] == len(answers)
    assert len(fast_out) == len(out) == 2
    for (f, f_meta, f_episodes), (g, g_meta, g_episodes) in zip(fast_out, out):
        assert f_meta == g_meta
        assert (f == g).all(), "fragments differ"
        assert all((f_episodes[k] == g_episodes[k]).all() for k in g_episodes)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_plain_observation_with_nan_is_refused_by_name(dtype):
    codec = TreeCodec(from_json(json.dumps(TREE)))
    data = np.full((2, 3), np.nan, dtype).tobytes()
    message = {"type": "act", "agents": {"agents_0": {"observation": {"dtype": dtype, "shape": [2, 3], "data": data}}}}
    with pytest.raises(ProtocolError, match="NaN or infinity"):
        codec.parse_act(message, "act")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("shape", [(), (2,)])
def test_action_maps_send_the_bytes_action_value_sends(dtype, shape):
    generator = torch.Generator().manual_seed(0)
    actions = {"a": (torch.randn(1, 3, *shape, generator=generator) * 5).to(dtype),
               "b": {"x": torch.arange(2).reshape(1, 2).to(dtype)}}
    agents = [("a_2", "a", 2), ("b_1", "b", 1), ("a_0", "a", 0)]
    want = {agent: action_value(actions[g], slot) for agent, g, slot in agents}
    assert encode({"actions": action_maps(actions, agents)}) == encode({"actions": want})
