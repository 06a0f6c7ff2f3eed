"""External episodes -> fragments (orchestration.external_episodes), and the protocol's codec: no network."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adapters.external.messages import ProtocolError, decode, encode, from_array, spec_hash, to_array
from core.specs import from_json
from core.layout import NEXT
from orchestration.assignment import assign
from adapters.external.codec import TreeCodec
from orchestration.external_episodes import Episode, Lanes

TREE = {"format": "shoal.tree/1", "tree": {"array": {
    "template": {"observation": {"leaf": "box", "shape": [2], "dtype": "float32", "low": "-inf", "high": "inf"},
                 "action": {"leaf": "discrete", "shape": [], "dtype": "int64", "n": 3, "start": 0}},
    "capacity": 3, "payoff": "cooperative", "shared_observation": None}}}


# -- codec ------------------------------------------------------------------------------------------------------
@given(dtype=st.sampled_from(["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]),
       shape=st.lists(st.integers(0, 4), max_size=3), seed=st.integers(0, 2**16))
def test_arrays_round_trip_bit_for_bit(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    a = (rng.random(shape) * 100).astype(dtype)
    back = to_array(decode(encode({"type": "act", "x": a}), max_bytes=1 << 20)["x"], "x")
    assert back.dtype == a.dtype and back.shape == a.shape and back.tobytes() == a.tobytes()


def test_decode_refuses_what_the_protocol_does_not_allow():
    with pytest.raises(ProtocolError, match="text frame"):
        decode("{}", max_bytes=100)
    with pytest.raises(ProtocolError) as error:
        decode(b"x" * 200, max_bytes=100)
    assert error.value.code == "too_large"
    with pytest.raises(ProtocolError, match="extension type"):
        decode(msgpack.packb({"type": "act", "x": msgpack.ExtType(1, b"evil")}), max_bytes=100)
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(encode({"type": "exec"}), max_bytes=100)
    with pytest.raises(ProtocolError, match=r"not a MessagePack message \(FormatError\)$"):  # not 'FormatError: '
        decode(b"\xc1\xc1", max_bytes=100)
    bad = from_array(np.zeros(3, np.float32))
    bad["data"] = bad["data"][:-1]
    with pytest.raises(ProtocolError, match="11 bytes"):
        to_array(bad, "obs")
    with pytest.raises(ProtocolError, match="dtype 'object'"):
        to_array({"dtype": "object", "shape": [1], "data": b"x"}, "obs")


def test_spec_hash_ignores_key_order():
    shuffled = json.loads(json.dumps(TREE))
    shuffled["tree"]["array"] = dict(reversed(list(shuffled["tree"]["array"].items())))
    assert spec_hash(shuffled) == spec_hash(TREE)


# -- recording ----------------------------------------------------------------------------------------------------
def _setup(fragment_length):
    tree = from_json(json.dumps(TREE))
    codec = TreeCodec(tree)
    out = []
    lanes = Lanes(codec, assign(tree, {}), fragment_length, lambda *item: out.append(item))
    return codec, lanes, out


def _act(codec, episode, agents, rewards=None, left=None):
    message = {"agents": {a: {"observation": np.full(2, v, np.float32)} for a, v in agents.items()}}
    if rewards:
        message["rewards"] = rewards
    if left:
        message["left"] = left
    request = codec.parse_act(_wire(message), "test")
    episode.consequences(request)
    action = torch.tensor([[7, 8, 9]])
    episode.act(request, {"agents": {"action": action, "log_prob": torch.full((1, 3, 1), -1.0)}}, {"agents": 4})
    return request


def test_a_scripted_episode_becomes_the_fragment_a_batched_env_would_give():
    codec, lanes, out = _setup(fragment_length=4)
    ep = Episode(lanes, "e")
    _act(codec, ep, {"agents_0": 1.0, "agents_1": 2.0})
    _act(codec, ep, {"agents_0": 3.0}, rewards={"agents_0": 0.5, "agents_1": 0.25}, left={"agents_1": "terminated"})
    _act(codec, ep, {"agents_0": 5.0, "agents_2": 6.0}, rewards={"agents_0": 1.0})
    ep.end("truncated", *_end(codec, {"agents_0": 2.0, "agents_2": 3.0},
                               {"agents_0": np.full(2, 9.0, np.float32), "agents_2": np.full(2, 10.0, np.float32)}))
    assert len(out) == 0 and lanes.pending_steps == 3  # 3 of T=4 steps: no fragment yet
    ep2 = Episode(lanes, "f")  # the lane continues its row with the next episode
    assert ep2.lane == ep.lane
    _act(codec, ep2, {"agents_1": 4.0})
    _act(codec, ep2, {"agents_1": 4.5}, rewards={"agents_1": 1.0})
    assert not out  # ep2's first step is complete but held back (a disconnect could still truncate it)
    _act(codec, ep2, {"agents_1": 5.0})
    (fragment, meta, episodes), = out
    assert fragment.batch_size == (1, 4) and meta["sequence"] == 0 and meta["policy_versions"] == {"agents": 4}
    mask = fragment["agents", "mask"][0]
    assert mask.tolist() == [[True, True, False], [True, False, False], [True, False, True], [False, True, False]]
    reward = fragment[NEXT, "agents", "reward"][0, ..., 0]
    assert reward.tolist() == [[0.5, 0.25, 0.0], [1.0, 0.0, 0.0], [2.0, 0.0, 3.0], [0.0, 1.0, 0.0]]
    terminated = fragment[NEXT, "agents", "terminated"][0, ..., 0]
    assert terminated[0].tolist() == [False, True, False]  # agents_1 left at step 0's consequences
    next_obs = fragment[NEXT, "agents", "observation"][0, ..., 0]
    assert next_obs[0].tolist() == [3.0, 2.0, 0.0]  # agents_0 asked again; agents_1 (left) keeps its own
    assert next_obs[2].tolist() == [9.0, 0.0, 10.0]  # the end's final observations
    done = fragment[NEXT, "done"][0, :, 0].tolist()
    assert done == [False, False, True, False]
    assert fragment[NEXT, "truncated"][0, 2, 0] and not fragment[NEXT, "terminated"][0, 2, 0]
    assert episodes["return"].tolist() == [0.5 + 0.25 + 1.0 + 2.0 + 3.0]
    assert fragment["episode_id"][0].tolist()[2] != fragment["episode_id"][0].tolist()[3]
    assert lanes.counters["approx_bootstraps"] == 0


def _wire(message):
    """``message`` as the server reads it: through MessagePack and back."""
    return decode(encode({"type": "act", **message}), max_bytes=1 << 20)


def _end(codec, rewards, observations):
    message = _wire({"rewards": rewards, "observations": observations})
    reward, _ = codec.consequences(message, "end")
    return reward, codec.parse_final(message, "end")


def test_a_cut_episode_keeps_complete_steps_truncated_and_counts_the_open_one():
    codec, lanes, out = _setup(fragment_length=2)
    ep = Episode(lanes, "e")
    _act(codec, ep, {"agents_0": 1.0})
    _act(codec, ep, {"agents_0": 2.0}, rewards={"agents_0": 1.0})
    _act(codec, ep, {"agents_0": 3.0}, rewards={"agents_0": 1.0})
    ep.cut()  # two complete steps, one open: its consequences never come
    (fragment, meta, episodes), = out
    assert fragment[NEXT, "done"][0, :, 0].tolist() == [False, True]
    assert fragment[NEXT, "truncated"][0, 1, 0] and fragment[NEXT, "agents", "truncated"][0, 1, 0, 0]
    assert lanes.counters == {**lanes.counters, "steps_lost": 1, "episodes_cut": 1, "steps_recorded": 2}
    assert episodes["return"].tolist() == [2.0]


def test_an_agent_absent_at_the_next_request_is_counted_as_an_approximate_bootstrap():
    codec, lanes, _ = _setup(fragment_length=8)
    ep = Episode(lanes, "e")
    _act(codec, ep, {"agents_0": 1.0, "agents_1": 1.0})
    _act(codec, ep, {"agents_0": 2.0})  # agents_1 neither asks nor leaves
    assert lanes.counters["approx_bootstraps"] == 1


def test_bad_requests_name_the_agent_and_field():
    codec, _, _ = _setup(fragment_length=8)
    with pytest.raises(ProtocolError, match="unknown agent 'agents_7'"):
        codec.parse_act(_wire({"agents": {"agents_7": {"observation": np.zeros(2, np.float32)}}}), "act 3")
    with pytest.raises(ProtocolError, match=r"agents_0.*shape \[3\], the tree says \[2\]"):
        codec.parse_act(_wire({"agents": {"agents_0": {"observation": np.zeros(3, np.float32)}}}), "act 3")
    with pytest.raises(ProtocolError, match="does not convert without loss"):
        codec.parse_act(_wire({"agents": {"agents_0": {"observation": np.zeros(2, np.int64)}}}), "act 3")
    with pytest.raises(ProtocolError, match="NaN"):
        codec.parse_act(_wire({"agents": {"agents_0": {"observation": np.array([np.nan, 0], np.float32)}}}), "act 3")
    with pytest.raises(ProtocolError, match=r"action_mask allows no action \(all False\)"):
        codec.parse_act(_wire({"agents": {"agents_0": {"observation": np.zeros(2, np.float32),
                                                       "action_mask": np.zeros(3, bool)}}}), "act 3")
    with pytest.raises(ProtocolError, match=r"action_mask must be bool \[3\], got bool \[4\]"):
        codec.parse_act(_wire({"agents": {"agents_0": {"observation": np.zeros(2, np.float32),
                                                       "action_mask": np.ones(4, bool)}}}), "act 3")
    with pytest.raises(ProtocolError, match="left"):
        codec.parse_act(_wire({"agents": {"agents_0": {"observation": np.zeros(2, np.float32)}},
                               "left": {"agents_1": "exploded"}}), "act 3")
