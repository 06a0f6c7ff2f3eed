"""to_wire / from_wire: TensorDicts as numpy views plus metadata, round trips bit for bit (no Ray needed)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from orchestration.wire import from_wire, to_wire, wire_meta, wire_nbytes

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool, torch.bfloat16,
          torch.float16]


def _leaf(shape, dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@st.composite
def fragments(draw) -> TensorDict:
    """A fragment-like TensorDict: root ``[E, T]``, a group ``[E, T, A]``, ``next`` with a nested group."""
    e, t, a = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    dtype = draw(st.sampled_from(DTYPES))
    agents = TensorDict({"observation": _leaf((e, t, a, 3), dtype, g), "mask": _leaf((e, t, a), torch.bool, g),
                         "log_prob": _leaf((e, t, a, 1), torch.float32, g)}, batch_size=[e, t, a])
    nxt = TensorDict({"agents": TensorDict({"reward": _leaf((e, t, a, 1), dtype, g)}, batch_size=[e, t, a]),
                      "done": _leaf((e, t, 1), torch.bool, g)}, batch_size=[e, t])
    return TensorDict({"agents": agents, "next": nxt, "fragment_id": _leaf((e, t), torch.int64, g)}, batch_size=[e, t])


def _assert_identical(a: TensorDict, b: TensorDict) -> None:
    assert a.batch_size == b.batch_size
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key, value in a.items(True):
        other = b.get(key)
        if isinstance(value, TensorDict):
            assert other.batch_size == value.batch_size, key
        else:
            assert other.dtype == value.dtype and other.shape == value.shape, key
            # bit-exact, NaN payloads included: compare the raw bytes
            assert torch.equal(other.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), key


@given(td=fragments())
def test_round_trip_keeps_group_batch_sizes_bit_exact(td):
    msg = pickle.loads(pickle.dumps(to_wire(td, {"version": 3}), protocol=5))  # what Ray's transport does
    out = from_wire(msg)
    _assert_identical(td, out)
    assert out["agents"].batch_size == td["agents"].batch_size and out["next", "agents"].batch_size.numel() > 0
    assert wire_meta(msg) == {"version": 3}


def test_to_wire_makes_no_copy_and_from_wire_shares_memory():
    td = TensorDict({"x": torch.arange(12.0).reshape(3, 4)}, batch_size=[3])
    msg = to_wire(td)
    array = dict(msg["leaves"])[("x",)]
    assert np.shares_memory(array, td["x"].numpy())
    assert wire_nbytes(msg) == 48
    assert from_wire(msg)["x"].data_ptr() == td["x"].data_ptr()
    assert from_wire(msg, copy=True)["x"].data_ptr() != td["x"].data_ptr()


def test_read_only_arrays_rebuild_without_warning_and_copy_is_writable():
    td = TensorDict({"x": torch.ones(2, 2)}, batch_size=[2])
    msg = to_wire(td.clone())
    for _, array in msg["leaves"]:
        array.flags.writeable = False  # as the arrays of a Ray get are
    with _no_warnings():
        view = from_wire(msg)
    assert torch.equal(view["x"], td["x"])
    owned = from_wire(msg, copy=True)
    owned["x"].add_(1.0)  # would fault on object-store memory; fine on the copy
    assert torch.equal(owned["x"], td["x"] + 1)


class _no_warnings:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_non_contiguous_and_grad_leaves_travel():
    base = torch.randn(4, 6, requires_grad=True)
    td = TensorDict({"t": base.t(), "g": base.t() * 2}, batch_size=[6])
    out = from_wire(to_wire(td))
    assert torch.equal(out["t"], base.t().detach()) and torch.equal(out["g"], (base.t() * 2).detach())
    assert not out["g"].requires_grad


def test_empty_groups_and_scalars_survive():
    td = TensorDict({"empty": TensorDict({}, batch_size=[2, 5]), "s": torch.zeros(2)}, batch_size=[2])
    out = from_wire(to_wire(td))
    assert out["empty"].batch_size == torch.Size([2, 5]) and torch.equal(out["s"], td["s"])
    scalar = TensorDict({"v": torch.tensor(3)}, batch_size=[])
    assert from_wire(to_wire(scalar))["v"].item() == 3


def test_weights_load_bit_exact_into_a_module():
    torch.manual_seed(0)
    src, dst = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), \
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    msg = pickle.loads(pickle.dumps(to_wire(TensorDict.from_module(src).detach()), protocol=5))
    with torch.no_grad():
        TensorDict.from_module(dst).update_(from_wire(msg))
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b)


def test_non_tensor_data_is_refused():
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    td.set("name", "cartpole")
    with pytest.raises(TypeError, match="name"):
        to_wire(td)


def test_unknown_format_is_refused():
    msg = to_wire(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))
    msg["format"] = 99
    with pytest.raises(ValueError, match="format"):
        from_wire(msg)
