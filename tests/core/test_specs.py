"""Spec tree tests: construction errors name the path, layout, round trips, validation, deployment view."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.specs import (AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, SpecViolation, TreeError,
                        default_policy_mapping, deployment_view, from_composite, from_json, groups, rand,
                        to_composite, to_json, validate, zeros)

ADVERSARY = AgentNode(
    observation=DictNode({"pos": Leaf.box((2,), -1.0, 1.0), "radar": Leaf.box((3,), eval_only=True)}),
    action=Leaf.discrete(5),
)
PREY = AgentNode(observation=Leaf.box((4,)), action=Leaf.box((2,), -1.0, 1.0))
TREE = DictPopulation(
    members={"adversary_0": ADVERSARY, "adversary_1": ADVERSARY, "prey_0": PREY,
             "swarm": ArrayPopulation(template=PREY, capacity=3)},
    payoff="zero_sum",
    shared_observation=DictNode({"state": Leaf.box((6,), eval_only=True), "clock": Leaf.discrete(10)}),
)


def leaves():
    box = st.builds(lambda shape, lo, w: Leaf.box(shape, lo, lo + w),
                    st.lists(st.integers(1, 3), max_size=2).map(tuple), st.floats(-5, 5), st.floats(0, 5))
    return st.one_of(box, st.integers(1, 6).map(Leaf.discrete),
                     st.lists(st.integers(1, 4), min_size=1, max_size=3).map(Leaf.multi_discrete),
                     st.integers(1, 4).map(Leaf.binary))


def nodes(max_depth=2):
    names = st.sampled_from(["a", "b", "c", "0", "1"])
    return st.recursive(leaves(), lambda kids: st.dictionaries(names, kids, min_size=1, max_size=3).map(DictNode),
                        max_leaves=4)


@st.composite
def trees(draw):
    members = {}
    for i in range(draw(st.integers(1, 3))):
        agent = AgentNode(observation=draw(nodes()), action=draw(nodes()))
        members[f"m{i}"] = (ArrayPopulation(template=agent, capacity=draw(st.integers(1, 3)))
                            if draw(st.booleans()) else agent)
    return DictPopulation(members=members, payoff=draw(st.sampled_from(["cooperative", "zero_sum", "general"])),
                          shared_observation=draw(st.none() | nodes()))


def test_groups_follow_prefix_and_spaces():
    g = groups(TREE)
    assert list(g) == ["adversary", "prey", "swarm"]
    assert g["adversary"].agent_names == ("adversary_0", "adversary_1")
    assert g["swarm"].capacity == 3 and g["swarm"].is_array
    assert g["prey"].payoff == "zero_sum"
    mapping = default_policy_mapping(TREE)
    assert mapping["adversary_1"] == "adversary" and mapping["swarm_2"] == "swarm" and mapping["prey_0"] == "prey"


def test_same_prefix_different_spaces_split_into_groups():
    tree = DictPopulation(members={"x_0": PREY, "x_1": ADVERSARY})
    assert [g.agent_names for g in groups(tree).values()] == [("x_0",), ("x_1",)]


def test_zeros_layout_has_agent_dim_and_masks():
    td = zeros(TREE, (4, 5))
    assert td["adversary", "observation", "pos"].shape == (4, 5, 2, 2)
    assert td["swarm", "mask"].shape == (4, 5, 3) and not td["swarm", "mask"].any()
    assert td["adversary", "action_mask"].shape == (4, 5, 2, 5)
    assert td["shared", "state"].shape == (4, 5, 6)
    assert td["adversary"].batch_size == (4, 5, 2)


def test_zeros_respects_bounds_without_zero():
    leaf = Leaf("discrete", (), torch.int64, n=3, start=2)
    td = zeros(AgentNode(observation=Leaf.box((1,), 1.0, 2.0), action=leaf), (2,))
    assert td["agent", "observation"].eq(1.0).all() and td["agent", "action"].eq(2).all()


@given(tree=trees(), seed=st.integers(0, 2**31))
def test_rand_is_valid_and_inside_the_torchrl_spec(tree, seed):
    td = rand(tree, (3,), torch.Generator().manual_seed(seed))
    validate(td, tree, parts=("observation", "action"))
    assert to_composite(tree, (3,)).is_in(td)


@given(tree=trees())
def test_json_round_trip_is_lossless(tree):
    assert from_json(to_json(tree)) == tree


@settings(max_examples=15)  # torchrl spec construction is slow (~ms per leaf)
@given(tree=trees())
def test_composite_round_trip_keeps_groups_and_leaves(tree):
    back = from_composite(to_composite(tree, (2,)))
    for (name, g), (name2, g2) in zip(groups(tree).items(), groups(back).items()):
        assert name == name2 and g.capacity == g2.capacity
        assert to_composite(AgentNode(observation=g.agent.observation, action=g.agent.action)) == \
            to_composite(AgentNode(observation=g2.agent.observation, action=g2.agent.action))


def test_composite_round_trip_of_the_example_tree():
    back = from_composite(to_composite(TREE))
    assert to_composite(back) == to_composite(TREE)


def test_json_keeps_tags_payoff_and_infinite_bounds():
    text = to_json(TREE)
    assert "Infinity" not in text and '"-inf"' in text
    back = from_json(text)
    assert back.payoff == "zero_sum" and back.members["adversary_0"].observation.children["radar"].eval_only
    assert math.isinf(back.members["prey_0"].observation.low)


def test_deployment_view_drops_exactly_the_eval_only_leaves():
    view = deployment_view(TREE)
    assert list(view.members["adversary_0"].observation.children) == ["pos"]
    assert list(view.shared_observation.children) == ["clock"]
    assert view.members["prey_0"] == PREY and view.members["swarm"] == TREE.members["swarm"]
    with pytest.raises(ValueError, match="eval_only"):
        deployment_view(AgentNode(observation=Leaf.box((1,), eval_only=True), action=Leaf.discrete(2)))


@pytest.mark.parametrize("build, path", [
    (lambda: AgentNode(observation=Leaf.box((2,)), action=Leaf.box((1,), eval_only=True)), "action"),
    (lambda: AgentNode(observation=DictNode({"bad name": Leaf.box((1,))}), action=Leaf.discrete(2)), "observation"),
    (lambda: AgentNode(observation=DictNode({"x": Leaf.box((1,))}, atomic=False), action=Leaf.discrete(2)),
     "observation"),
    (lambda: ArrayPopulation(template=PREY, capacity=0), "capacity"),
    (lambda: DictPopulation(members={"a": PREY}, payoff="friendly"), "payoff"),
    (lambda: DictPopulation(members={"a": 3}), "a"),
    (lambda: DictPopulation(members={"a": AgentNode(observation=DictNode({"p": DictNode({})}),
                                                     action=Leaf.discrete(2))}), "observation/p"),
])
def test_invalid_trees_raise_naming_the_path(build, path):
    with pytest.raises(TreeError) as err:
        build()
    assert err.value.path.startswith(path) or path in str(err.value)


def test_invalid_leaves_raise():
    with pytest.raises(TreeError):
        Leaf.box((2,), low=1.0, high=0.0)
    with pytest.raises(TreeError):
        Leaf.discrete(0)
    with pytest.raises(TreeError):
        Leaf("discrete", (), torch.float32, n=3)


def test_validation_names_key_agent_and_env():
    td = rand(TREE, (4,), torch.Generator().manual_seed(0))
    td["adversary", "observation", "pos"][2, 1, 0] = 5.0
    with pytest.raises(SpecViolation) as err:
        validate(td, TREE)
    e = err.value
    assert e.key == ("adversary", "observation", "pos") and e.agent == "adversary_1" and e.env == 2
    assert "outside bounds" in str(e)


def test_validation_ignores_absent_agents_but_checks_shapes_and_dtypes():
    td = rand(TREE, (4,), torch.Generator().manual_seed(0))
    td["swarm", "observation"][1, 2] = float("nan")
    td["swarm", "mask"][1, 2] = False
    validate(td, TREE)  # the NaN sits in an absent agent's padding
    td["swarm", "mask"][1, 2] = True
    with pytest.raises(SpecViolation, match="NaN") as err:
        validate(td, TREE)
    assert err.value.agent == "swarm_2" and err.value.env == 1
    bad = td.clone()
    bad["prey", "observation"] = bad["prey", "observation"].double()
    with pytest.raises(SpecViolation, match="dtype"):
        validate(bad, TREE)
    bad = rand(TREE, (4,), torch.Generator().manual_seed(1))
    del bad["shared", "state"]
    with pytest.raises(SpecViolation, match="missing") as err:
        validate(bad, TREE)
    assert err.value.key == ("shared", "state")


def test_single_agent_tree_becomes_one_group():
    tree = AgentNode(observation=Leaf.box((4,)), action=Leaf.discrete(2))
    assert list(groups(tree)) == ["agent"]
    assert zeros(tree, (8,))["agent", "observation"].shape == (8, 1, 4)


def test_agent_names_are_unique_across_groups_and_groups_keep_off_the_layouts_keys():
    """Nested populations that both had an agent 'scout' mapped both groups to one policy (of the other's spaces),
    in silence; an agent named 'next', 'shared' or 'done' failed deep in the actor or the loss."""
    from core.specs import AgentNode, DictPopulation, Leaf, TreeError, groups

    a3 = AgentNode(observation=Leaf.box((3,)), action=Leaf.discrete(2))
    a5 = AgentNode(observation=Leaf.box((5,)), action=Leaf.discrete(2))
    with pytest.raises(TreeError, match=r"blue/scout: agent name 'scout' is also in group 'red/scout'"):
        groups(DictPopulation({"red": DictPopulation({"scout": a3}), "blue": DictPopulation({"scout": a5})}))
    for reserved in ("next", "shared", "done", "env_id"):
        with pytest.raises(TreeError, match=f"{reserved}: a group of this name would take a key of Shoal's layout"):
            groups(DictPopulation({reserved: a3}))
    two = DictPopulation({"red": DictPopulation({"scout": a3}), "blue": DictPopulation({"ranger": a5})})
    assert list(groups(two)) == ["red/scout", "blue/ranger"]


def test_a_discrete_leaf_whose_dtype_cannot_hold_its_values_is_refused():
    """``Leaf.discrete(1000, dtype=torch.int8)`` built, and a policy then sampled actions in -128..127."""
    from core.specs import Leaf, TreeError

    with pytest.raises(TreeError, match=r"values reach 999, past what torch.int8 holds \(127\): give "
                                        r"dtype=torch.int16"):
        Leaf.discrete(1000, dtype=torch.int8)
    with pytest.raises(TreeError, match="values reach 299, past what torch.uint8 holds"):
        Leaf.multi_discrete([3, 300], dtype=torch.uint8)
    assert Leaf.discrete(256, dtype=torch.uint8).n == 256 and Leaf.discrete(2, dtype=torch.bool).n == 2
    with pytest.raises(TreeError, match="no integer dtype holds them"):  # was a StopIteration picking one
        Leaf.discrete(2**64)


def test_validate_takes_one_part_named_as_a_string():
    """``validate(td, tree, parts="action")`` iterated the string letter by letter ("agent/a: missing")."""
    from core.specs import AgentNode, DictPopulation, Leaf, zeros
    from core.specs.validate import validate

    tree = DictPopulation({"agent": AgentNode(observation=Leaf.box((2,)), action=Leaf.discrete(3))})
    td = zeros(tree, [2])
    validate(td, tree, parts="action")
    validate(td, tree, parts=("observation", "action"))


def test_leaf_sizes_are_whole_numbers_and_bounds_are_numbers():
    """``Leaf.discrete(2.7)`` made 2 choices, ``Leaf.box((2.5,))`` a shape of 2, and a NaN bound was kept."""
    import numpy as np

    from core.specs import Leaf, TreeError

    for build, named in ((lambda: Leaf.discrete(2.7), "n must be a whole number, got 2.7"),
                         (lambda: Leaf.box((2.5,)), "a box's shape must be a whole number, got 2.5"),
                         (lambda: Leaf.multi_discrete([2, 3.5]), "nvec must be a whole number, got 3.5"),
                         (lambda: Leaf.box((2,), low=[0.0, float("nan")]), "low holds NaN")):
        with pytest.raises(TreeError, match=named):
            build()
    assert Leaf.discrete(np.int64(3)).n == Leaf.discrete(3.0).n == 3 and Leaf.box(torch.Size([2])).shape == (2,)
