"""Gymnasium spaces -> tree nodes, and batch conversion of samples (adapters/spaces.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector.utils import batch_space
from hypothesis import given, strategies as st

from adapters.spaces import SpaceCodec, UnsupportedSpaceError, pad_value, space_to_node
from core.specs import AgentNode, DictNode, Leaf, TreeError, leaf_to_torchrl


def test_box_keeps_shape_bounds_and_dtype():
    leaf = space_to_node(spaces.Box(low=np.array([0, -1], np.float32), high=np.array([1, 2], np.float32)))
    assert leaf == Leaf.box((2,), low=[0, -1], high=[1, 2])
    image = space_to_node(spaces.Box(0, 255, (4, 4, 3), np.uint8))
    assert (image.kind, image.shape, image.dtype, image.low, image.high) == ("box", (4, 4, 3), torch.uint8, 0.0, 255.0)
    assert space_to_node(spaces.Box(-np.inf, np.inf, (3,), np.float64)).dtype == torch.float64


def test_discrete_multidiscrete_multibinary():
    assert space_to_node(spaces.Discrete(5, start=-2)) == Leaf.discrete(5, start=-2)
    assert space_to_node(spaces.MultiDiscrete([3, 4])) == Leaf.multi_discrete([3, 4])
    # a multi-dim MultiDiscrete is flattened row-major; a start offset is removed (values 0..nvec-1)
    assert space_to_node(spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[1, 1], [1, 1]])) == \
        Leaf.multi_discrete([2, 3, 4, 5])
    assert space_to_node(spaces.MultiBinary(3)) == Leaf.binary(3)
    assert space_to_node(spaces.MultiBinary((2, 3))) == Leaf.binary(6)


def test_dict_and_mixed_tuple_become_keyed_dict_nodes():
    space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,)),
                         "inv": spaces.Tuple((spaces.Discrete(3), spaces.Box(0, 1, (1,)), spaces.MultiBinary(2)))})
    node = space_to_node(space, "agent/observation", eval_only=True)
    # children follow the space's own order (gymnasium sorts the keys of a plain dict)
    assert isinstance(node, DictNode) and list(node.children) == list(space.spaces) == ["inv", "pos"]
    inv = node.children["inv"]
    assert list(inv.children) == ["0", "1", "2"]
    assert [c.kind for c in inv.children.values()] == ["discrete", "box", "binary"]
    assert all(leaf.eval_only for leaf in [node.children["pos"], *inv.children.values()])
    AgentNode(observation=node, action=Leaf.discrete(2))  # a valid tree


@pytest.mark.parametrize("space, kind", [
    (spaces.Text(5), "Text"),
    (spaces.Graph(node_space=spaces.Box(0, 1, (2,)), edge_space=None), "Graph"),
    (spaces.Sequence(spaces.Discrete(2)), "Sequence"),
    (spaces.OneOf((spaces.Discrete(2), spaces.Box(0, 1, (2,)))), "OneOf"),
])
def test_variable_spaces_raise_naming_space_and_path(space, kind):
    nested = spaces.Dict({"ok": spaces.Discrete(2), "inner": spaces.Tuple((spaces.Discrete(2), space))})
    with pytest.raises(UnsupportedSpaceError) as info:
        space_to_node(nested, "predator_0/observation")
    assert info.value.path == "predator_0/observation/inner/1"
    assert kind in str(info.value) and "predator_0/observation/inner/1" in str(info.value)
    assert info.value.space is space
    assert isinstance(info.value, TreeError)


def test_bad_dict_key_and_empty_tuple_raise():
    with pytest.raises(UnsupportedSpaceError, match="key 'my key'"):
        space_to_node(spaces.Dict({"my key": spaces.Discrete(2)}), "obs")
    with pytest.raises(UnsupportedSpaceError, match="empty"):
        space_to_node(spaces.Tuple(()), "obs")


NESTED = spaces.Dict({
    "pos": spaces.Box(-1, 1, (2,), np.float32),
    "grid": spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[1, 0], [-2, 3]]),
    "t": spaces.Tuple((spaces.Discrete(3, start=1), spaces.MultiBinary((2, 2)))),
})


@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5))
def test_batch_roundtrip_and_values_inside_leaf_specs(seed, batch):
    codec = SpaceCodec(NESTED)
    batched = batch_space(NESTED, batch)
    batched.seed(seed)
    sample = batched.sample()
    arrays = codec.flatten(sample, (batch,))
    node = space_to_node(NESTED)
    leaves = [node.children["grid"], node.children["pos"], *node.children["t"].children.values()]
    assert [c.key for c in codec.leaves] == [("grid",), ("pos",), ("t", "0"), ("t", "1")]
    for arr, leaf in zip(arrays, leaves):
        assert arr.shape == (batch, *leaf.shape)
        assert leaf_to_torchrl(leaf).expand(batch, *leaf.shape).is_in(torch.from_numpy(arr).to(leaf.dtype))
    back = codec.unflatten(arrays, (batch,))
    np.testing.assert_array_equal(back["pos"], sample["pos"])
    np.testing.assert_array_equal(back["grid"], sample["grid"])
    np.testing.assert_array_equal(back["t"][0], sample["t"][0])
    np.testing.assert_array_equal(back["t"][1], sample["t"][1])
    assert batched.contains(back)


def test_flatten_of_a_plain_box_does_not_copy():
    codec = SpaceCodec(spaces.Box(-1, 1, (4,)))
    arr = np.zeros((8, 4), np.float32)
    (out,) = codec.flatten(arr, (8,))
    assert out is arr


def test_write_checks_shape_and_dtype_per_sample():
    codec = SpaceCodec(NESTED)
    bufs = codec.buffers((2, 3))
    sample = NESTED.sample()
    assert codec.write(sample, bufs, (1, 2)) is None
    np.testing.assert_array_equal(bufs[1][1, 2], sample["pos"])
    np.testing.assert_array_equal(bufs[0][1, 2], (sample["grid"] - NESTED["grid"].start).reshape(-1))
    wrong = {**sample, "pos": np.zeros(3, np.float32)}
    assert codec.write(wrong, bufs, (0, 0)) == (("pos",), "expected shape (2,), got (3,)")
    key, message = codec.write({**sample, "t": (1.5, sample["t"][1])}, bufs, (0, 0))
    assert key == ("t", "0") and "dtype" in message
    assert codec.write({"pos": sample["pos"]}, bufs, (0, 0)) == (("grid",), "missing")
    assert codec.write({"grid": sample["grid"]}, bufs, (0, 0)) == (("pos",), "missing")
    # float64 into a float32 box is the same kind: accepted
    assert codec.write({**sample, "pos": sample["pos"].astype(np.float64)}, bufs, (0, 1)) is None


def test_buffers_hold_padding_inside_bounds():
    leaf = space_to_node(spaces.Discrete(3, start=2))
    assert pad_value(leaf) == 2
    codec = SpaceCodec(spaces.Dict({"a": spaces.Box(1, 2, (2,)), "b": spaces.Discrete(3, start=2)}))
    a, b = codec.buffers((4,))
    assert (a == 1).all() and (b == 2).all() and a.dtype == np.float32 and b.dtype == np.int64
    assert math.prod(a.shape) == 8
