"""Built-in batched envs in torch: CartPole (gymnasium CartPole-v1 dynamics) and Spread (cooperative,
agents join and leave). Their gymnasium / PettingZoo views live in :mod:`adapters.builtin.views`, imported
on demand so that the envs themselves need neither package."""

from .cartpole import CARTPOLE_TREE, CartPole, CartPoleConfig, cartpole_dynamics
from .spread import Spread, SpreadConfig, spread_tree

__all__ = ["CARTPOLE_TREE", "CartPole", "CartPoleConfig", "Spread", "SpreadConfig", "cartpole_dynamics", "spread_tree"]
