"""GroupPolicy refuses, by name, what it cannot take: another entry than its group's, an integer box action."""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict

from core.layout import OBSERVATION
from core.policies import PolicyConfig, make_policies
from core.specs import AgentNode, ArrayPopulation, DictNode, Leaf, rand


def _array(obs, action, capacity=3) -> ArrayPopulation:
    return ArrayPopulation(template=AgentNode(observation=obs, action=action), capacity=capacity)


def test_act_and_evaluate_refuse_what_is_not_the_groups_entry_by_name():
    tree = _array(Leaf.box((4,)), Leaf.discrete(2))
    policy, obs = make_policies(tree, PolicyConfig())["agents"], rand(tree, (4,), torch.Generator())["agents"]
    whole_step = TensorDict({"agents": obs}, batch_size=obs.batch_size[:1])
    for method, entry, got in (("act", obs[OBSERVATION], "a Tensor"), ("act", whole_step, "keys ['agents']"),
                               ("evaluate", whole_step, "keys ['agents']")):
        said = rf"GroupPolicy.{method} of group 'agents' .*step\['agents'\].*{re.escape(got)}"
        with pytest.raises(TypeError, match=said):
            getattr(policy, method)(entry)


_AIM_IN_STEPS = DictNode({"move": Leaf.discrete(3), "aim": Leaf.box((2,), dtype=torch.int32)})


@pytest.mark.parametrize("action, where", [(Leaf.box((2,), dtype=torch.int64), "group agents: action:"),
                                           (_AIM_IN_STEPS, "group agents: action/aim:")])
def test_an_integer_box_action_is_refused_naming_its_group_and_path_and_what_would_fit(action, where):
    with pytest.raises(ValueError, match=re.escape(where) + ".*float dtype.*discrete / multi-discrete"):
        make_policies(_array(Leaf.box((3,)), action), PolicyConfig())
