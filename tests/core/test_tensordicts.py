"""The unchecked TensorDict constructors (tensordict private API, quarantined in core.tensordicts) build what
the checked constructor builds."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from core import tensordicts
from core.tensordicts import get_leaf, get_str, key_dict, make_td, nested_td


def _source():
    return {"a": torch.arange(6.0).reshape(3, 2),
            "g": TensorDict({"x": torch.ones(3, 4, 1)}, batch_size=[3, 4]), "f": torch.zeros(3, dtype=torch.bool)}


def test_make_td_equals_the_checked_constructor_and_behaves_like_one():
    fast, checked = make_td(_source(), torch.Size([3])), TensorDict(_source(), batch_size=[3])
    assert type(fast) is TensorDict and fast.batch_size == checked.batch_size and fast.device is None
    assert set(fast.keys(True, True)) == set(checked.keys(True, True))
    assert (fast == checked).all()
    assert (fast[1:] == checked[1:]).all() and (torch.stack([fast, fast]) == torch.stack([checked, checked])).all()
    fast.set("new", torch.ones(3))  # a usable TensorDict: writes, clones, indexing
    assert fast.clone()["new"].sum() == 3 and fast.get(("g", "x")).shape == (3, 4, 1)


def test_nested_td_turns_plain_dicts_into_tensordicts():
    td = nested_td({"a": {"b": torch.ones(2, 3)}, "c": torch.zeros(2)}, torch.Size([2]))
    assert isinstance(td.get("a"), TensorDict) and td.get(("a", "b")).shape == (2, 3)
    assert (td == TensorDict({"a": {"b": torch.ones(2, 3)}, "c": torch.zeros(2)}, batch_size=[2])).all()


def test_the_direct_path_is_taken_only_when_the_private_layout_matches():
    probe = TensorDict({"x": torch.zeros(1)}, batch_size=[1])
    layout = tuple(sorted(vars(probe)))
    assert tensordicts._DIRECT == (layout == tuple(sorted(tensordicts._FIELDS)) and tensordicts._new_unsafe is not None)


def test_clone_td_copies_every_leaf_of_a_view_into_fresh_storage():
    base = TensorDict({"a": torch.arange(12.0).reshape(6, 2),
                       "next": TensorDict({"g": TensorDict({"x": torch.ones(6, 4, 1)}, [6, 4]),
                                           "f": torch.zeros(6, 1, dtype=torch.bool)}, [6])}, batch_size=[6])
    view = base[2:5]
    copy, reference = tensordicts.clone_td(view), view.clone()
    assert type(copy) is TensorDict and copy.batch_size == reference.batch_size
    assert copy.get(("next", "g")).batch_size == (3, 4)
    assert set(copy.keys(True, True)) == set(reference.keys(True, True)) and (copy == reference).all()
    for key in copy.keys(True, True):
        assert copy.get(key).untyped_storage().data_ptr() != base.get(key).untyped_storage().data_ptr()
    base.get("a").fill_(-1.0)  # the source changes (a shared buffer's next step): the copy does not
    assert (copy.get("a") == torch.arange(4.0, 10.0).reshape(3, 2)).all()


def test_get_leaf_reads_what_get_reads_whatever_built_the_tensordict():
    action = torch.arange(6).reshape(3, 2)
    built = {"fast": make_td({"g": make_td({"action": action}, torch.Size([3, 2]))}, torch.Size([3])),
             "checked": TensorDict({"g": TensorDict({"action": action}, [3, 2])}, batch_size=[3])}
    stacked = torch.stack([built["checked"], built["checked"].clone()])  # a lazy stack or a TensorDict, by version
    for td in (*built.values(), built["checked"][1:], built["fast"].lock_(), stacked):
        assert torch.equal(get_leaf(td, "g", "action"), td.get(("g", "action"))), type(td)
    assert get_leaf(built["checked"], "g", "action") is action
    for missing in (("h", "action"), ("g", "other")):  # what td.get does with a missing key (None in 0.14)
        assert get_leaf(built["fast"], *missing) is built["fast"].get(missing)


def test_key_dict_and_get_str_read_what_the_public_api_reads():
    inner = TensorDict({"x": torch.ones(3, 2)}, [3, 2])
    built = {"checked": TensorDict({"g": inner, "f": torch.zeros(3)}, batch_size=[3]),
             "fast": make_td({"g": inner, "f": torch.zeros(3)}, torch.Size([3]))}
    stacked = torch.stack([built["checked"], built["checked"].clone()])
    for td in (*built.values(), built["checked"][1:], stacked):
        own = key_dict(td)
        assert set(own.keys()) == set(td.keys()), type(td)
        for key in td.keys():
            assert (get_str(td, key) == td.get(key)).all()
        assert get_str(td, "absent") is None
    assert key_dict(built["fast"])["g"] is inner and get_str(built["checked"], "g") is inner  # no copies
    plain = {"a": torch.ones(1)}
    assert key_dict(plain) is plain
