"""The policy configuration record: network sizes, critic kind, recurrence and initialisation, once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Activation = Literal["tanh", "relu", "elu", "silu", "gelu"]
ACTIVATIONS: tuple[str, ...] = ("tanh", "relu", "elu", "silu", "gelu")


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    """How a :class:`core.policies.GroupPolicy` is built (defaults follow CleanRL's ``ppo.py`` / MAPPO).

    Initialisation follows "The 37 Implementation Details of PPO", detail 2
    (https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/): orthogonal weights, zero
    biases, gain ``sqrt(2)`` in hidden layers, ``actor_output_gain`` on the policy output layer and
    ``critic_output_gain`` on the value output layer.
    """

    hidden_sizes: tuple[int, ...] = (64, 64)
    """Widths of the hidden layers of the actor trunk and (separately) of the critic trunk."""
    activation: Activation = "tanh"
    """Non-linearity after every hidden layer (tanh in CleanRL; on CPU computed by ``core.policies.fast_tanh``)."""
    agent_id_input: bool = False
    """Append the one-hot slot index of the agent to the actor (and critic) input; breaks agent symmetry."""
    critic: Literal["local", "central", "joint"] = "local"
    """"local" (IPPO): the critic reads the agent's own observation, eval-only leaves included. "central"
    (MAPPO): it also reads every agent's observation in the group (absent agents zeroed) and the shared
    observations of the group's population and its ancestors, eval-only leaves included. "joint" (MAPPO, one
    critic pass per env): the same joint input without the agent's own part (or its id), which is then alike
    for every agent of an env: the critic trunk runs once per env and its output layer gives one value per agent
    slot (a central critic runs its trunk once per agent); not with ``recurrent_critic``."""
    recurrent: bool = False
    """Put a recurrent cell (``recurrent_cell``) between the actor trunk and the action heads; the caller
    carries its state, learners train it by truncated BPTT over sequences (``PPOConfig.sequence_length``)."""
    recurrent_cell: Literal["gru", "lstm"] = "gru"
    """The cell of a recurrent policy: a GRU (state ``H`` wide) or an LSTM (state ``2H``: ``h`` then ``c``)."""
    recurrent_size: int = 64
    """Width ``H`` of the cell's hidden state (used when ``recurrent``)."""
    recurrent_critic: bool = False
    """Give the critic a cell of its own between its trunk and its output (needs ``recurrent``); its state is
    carried with the actor's, in the same ``recurrent_state`` leaf (actor part first)."""
    squash_bounded_actions: bool = True
    """Bounded box actions use a tanh-squashed Gaussian scaled to the bounds; False: a plain Gaussian
    (the env must clip, as CleanRL's continuous PPO does)."""
    log_std_init: float = 0.0
    """Initial value of the state-independent log standard deviation of Gaussian heads."""
    hidden_gain: float = math.sqrt(2.0)
    """Orthogonal-init gain of hidden layers (detail 2)."""
    actor_output_gain: float = 0.01
    """Orthogonal-init gain of the action-parameter layer: near-uniform initial policy (detail 2)."""
    critic_output_gain: float = 1.0
    """Orthogonal-init gain of the value output layer (detail 2)."""
    image_encoder: Literal["nature", "impala", "flatten"] = "nature"
    """Encoder of image leaves (3-D boxes with 1, 3 or 4 channels first or last and sides >= 8): the Nature
    DQN CNN (Mnih et al. 2015; a 3x3 variant below 36 pixels), the IMPALA CNN (Espeholt et al. 2018), or
    ``flatten`` (every pixel an MLP input as it is, as vectors are: uint8 pixels stay 0-255, where the CNNs scale
    them by 1/255)."""
    leaf_encoders: tuple[tuple[str, str], ...] = ()
    """Per-leaf overrides of ``image_encoder`` as ``(leaf, encoder)`` pairs, the leaf named as in exported
    programs (``observation`` for a bare leaf, ``observation/camera`` in a dict), e.g.
    ``(("observation/camera", "impala"), ("observation/depth", "flatten"))``; ``nature``/``impala`` need an
    image leaf."""
    image_features: int = 512
    """Width of an image encoder's output (its last linear layer)."""
    normalize_observations: bool = False
    """Standardise float vector observations with running mean and variance (clipped to +-10, as SB3's
    VecNormalize). The statistics are part of the policy's state: learners update them from every training
    batch, actors receive them with the weights, checkpoints keep them, exported programs apply them."""
    scale_rewards: bool = False
    """Divide rewards by the running standard deviation of the discounted return (``PPOConfig.gamma``) and clip
    them to +-10 before GAE, as SB3's VecNormalize (:mod:`core.policies.reward_scaling`). The statistics are part
    of the policy's state, as ``normalize_observations``' are; evaluation and episode metrics stay unscaled."""

    def __post_init__(self) -> None:
        sizes = self.hidden_sizes
        _check(isinstance(sizes, tuple) and all(_is_int(h) and h >= 1 for h in sizes), "hidden_sizes",
               "a tuple of ints >= 1", sizes)
        _check(self.activation in ACTIVATIONS, "activation", f"one of {ACTIVATIONS}", self.activation)
        _check(isinstance(self.agent_id_input, bool), "agent_id_input", "a bool", self.agent_id_input)
        _check(self.critic in ("local", "central", "joint"), "critic", "'local', 'central' or 'joint'", self.critic)
        _check(isinstance(self.recurrent, bool), "recurrent", "a bool", self.recurrent)
        _check(self.recurrent_cell in ("gru", "lstm"), "recurrent_cell", "'gru' or 'lstm'", self.recurrent_cell)
        _check(_is_int(self.recurrent_size) and self.recurrent_size >= 1, "recurrent_size", "an int >= 1",
               self.recurrent_size)
        _check(isinstance(self.recurrent_critic, bool), "recurrent_critic", "a bool", self.recurrent_critic)
        _check(not (self.recurrent_critic and self.critic == "joint"), "recurrent_critic",
               "False with critic='joint' (its one pass per env carries no per-agent state; use critic='central')",
               self.recurrent_critic)
        _check(self.recurrent or not self.recurrent_critic, "recurrent_critic",
               "False unless recurrent is True (set recurrent=True too)", self.recurrent_critic)
        _check(isinstance(self.squash_bounded_actions, bool), "squash_bounded_actions", "a bool",
               self.squash_bounded_actions)
        for name in ("log_std_init", "hidden_gain", "actor_output_gain", "critic_output_gain"):
            _check(isinstance(getattr(self, name), (int, float)) and math.isfinite(getattr(self, name)), name,
                   "a finite number", getattr(self, name))
        for name in ("hidden_gain", "actor_output_gain", "critic_output_gain"):
            _check(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        _check(self.image_encoder in ("nature", "impala", "flatten"), "image_encoder",
               "'nature', 'impala' or 'flatten'", self.image_encoder)
        _check(_is_int(self.image_features) and self.image_features >= 1, "image_features", "an int >= 1",
               self.image_features)
        _check(isinstance(self.leaf_encoders, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
            and pair[1] in ("nature", "impala", "flatten") for pair in self.leaf_encoders), "leaf_encoders",
            "(leaf, 'nature'|'impala'|'flatten') pairs", self.leaf_encoders)
        leaves = [pair[0] for pair in self.leaf_encoders]
        _check(len(set(leaves)) == len(leaves), "leaf_encoders", "pairs naming each leaf once",
               self.leaf_encoders)
        _check(isinstance(self.normalize_observations, bool), "normalize_observations", "a bool",
               self.normalize_observations)
        _check(isinstance(self.scale_rewards, bool), "scale_rewards", "a bool", self.scale_rewards)


def policy_config_from_dict(fields: dict) -> PolicyConfig:
    """A :class:`PolicyConfig` from its JSON form (``dataclasses.asdict`` through JSON: lists for tuples);
    unknown keys (a newer writer's) are ignored, bad values raise the config's own named errors."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(PolicyConfig)}
    values = {k: v for k, v in fields.items() if k in known}
    if "hidden_sizes" in values:
        values["hidden_sizes"] = tuple(values["hidden_sizes"])
    if "leaf_encoders" in values:
        values["leaf_encoders"] = tuple(tuple(pair) for pair in values["leaf_encoders"])
    return PolicyConfig(**values)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"PolicyConfig.{name} must be {expected}, got {got!r}")


__all__ = ["ACTIVATIONS", "Activation", "PolicyConfig", "policy_config_from_dict"]
