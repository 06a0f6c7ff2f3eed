"""Built-in batched envs in torch: CartPole (gymnasium CartPole-v1 dynamics), Spread (cooperative,
agents join and leave), Spot (a tiny image task for conv policies), Pick (a structured two-stage action) and
Recall (a memory task). Their gymnasium / PettingZoo views live in :mod:`adapters.builtin.views`, imported
on demand so that the envs themselves need neither package.

They trust the actions they are given (an actor samples them from the tree's action spaces): a step driven by
hand with an action outside its space is not refused, as the gymnasium and PettingZoo adapters refuse one
(a check would cost a reduction and, on CUDA, a host sync every step); :class:`adapters.checking.ActionCheck`
checks hand-made actions as those adapters do."""

from .cartpole import CARTPOLE_TREE, CartPole, CartPoleConfig, cartpole_dynamics
from .pick import Pick, PickConfig, pick_tree
from .recall import Recall, RecallConfig, recall_tree
from .spot import Spot, SpotConfig, spot_tree
from .spread import Spread, SpreadConfig, spread_tree

__all__ = ["CARTPOLE_TREE", "CartPole", "CartPoleConfig", "Pick", "PickConfig", "Recall", "RecallConfig", "Spot",
           "SpotConfig", "Spread", "SpreadConfig", "cartpole_dynamics", "pick_tree", "recall_tree", "spot_tree",
           "spread_tree"]
