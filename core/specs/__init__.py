"""The observation/action tree of seed 002 and pure functions over it."""

from .grouping import GroupSpec, agent_index, default_policy_mapping, groups, shared_observations
from .nodes import (AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, Node, Payoff, Population,
                    StructuredActionError, Tree, TreeError, check_node, iter_leaves, population)
from .serialize import from_json, node_from_dict, node_to_dict, to_json, tree_from_dict, tree_to_dict
from .structure import action_conditions, action_elements, action_mask_shapes, is_structured
from .tensors import (capacity_of, from_composite, leaf_bounds, leaf_from_torchrl, leaf_to_torchrl,
                      node_to_torchrl, rand, to_composite, zeros)
from .validate import SpecViolation, validate
from .views import deployment_view

__all__ = [
    "AgentNode", "ArrayPopulation", "DictNode", "DictPopulation", "GroupSpec", "Leaf", "Node", "Payoff",
    "Population", "SpecViolation", "StructuredActionError", "Tree", "TreeError", "action_conditions",
    "action_elements", "action_mask_shapes", "agent_index", "capacity_of", "check_node", "default_policy_mapping",
    "deployment_view", "from_composite", "from_json", "groups", "is_structured", "iter_leaves", "leaf_bounds",
    "leaf_from_torchrl", "leaf_to_torchrl", "node_from_dict", "node_to_dict", "node_to_torchrl", "population", "rand",
    "shared_observations", "tree_from_dict", "tree_to_dict", "to_composite", "to_json", "validate", "zeros",
]
