"""The policy of one agent group: an actor and a critic with parameters shared across the agent dim.

One forward pass serves every agent of every env: inputs are ``[*B, A, ...]`` (``A`` = group capacity),
``*B`` any leading dims (``[E]`` when acting, ``[N]`` or ``[E, T]`` when training). Layout (:mod:`core.layout`)::

    actor input   encode(own observation, eval-only leaves dropped) [+ one-hot slot id]
                  [+ the shared observations of its population and ancestors, eval-only dropped] [*B, A, F_a]
    actor         MLP trunk [-> recurrent cell] -> Linear -> action heads (one per action leaf)
    critic input  local:   encode(own observation, eval-only included) [+ id]                 [*B, A, F_c]
                  central: [own, every agent's (absent ones zeroed, slot order), shared] [+ id]
                  joint:   [every agent's (absent ones zeroed, slot order), shared]           [*B, F_c]
    critic        separate MLP trunk [-> recurrent cell] -> Linear -> state_value             [*B, A, 1]
                  (joint: the trunk runs once per env, its output layer has one unit per agent slot)

Recurrence (``config.recurrent``): a GRU or LSTM cell (:mod:`core.policies.recurrence`) between the actor
trunk and the heads, and with ``config.recurrent_critic`` one between the critic trunk and its output. The
caller carries one state ``[*B, A, S]`` (``S = state_size``: the actor cell's part, then the critic's):
:meth:`GroupPolicy.act` returns the state it used at ``RECURRENT_STATE`` (after zeroing rows where
``episode_start``; store it with the step) and the state for the next step at ``("next", RECURRENT_STATE)``.
Learners train by truncated BPTT over sequences (:meth:`GroupPolicy.evaluate_sequence`: each sequence starts
from its stored state, gradients flow through the carried state); :meth:`GroupPolicy.evaluate` recomputes one
step from its stored state (no gradient into earlier steps).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from core.layout import (ACTION, ACTION_MASK, ACTION_PARAMS, CRITIC_MASK, ENTROPY, LOG_PROB, MASK, NEXT, OBSERVATION,
                         RECURRENT_STATE, STATE_VALUE)
from core.specs import GroupSpec, Node, Tree, groups, iter_leaves, shared_observations

from .composite import ActionHeads
from .critic_inputs import central_input, joint_input
from .config import PolicyConfig
from .distributions import CategoricalHead
from .networks import (ObservationEncoder, OutputLinear, Path, SharedEncoder, check_group_entry, check_leaf_names,
                       init_linear_, mlp, read_path, run_layers)
from .recurrence import cell_step, make_cell, state_size
from .sequences import SequenceEvaluation
from .reward_scaling import RewardScaler


#: Policies whose heads take more params than this compute log-probabilities per step (GroupPolicy.defers_log_prob).
_DEFER_MAX_PARAMS = 64


class GroupPolicy(SequenceEvaluation, nn.Module):
    """Actor-critic for one group (module docstring), built from its :class:`core.specs.GroupSpec`.

    Args:
        group: the group (``core.specs.groups(tree)[name]``).
        config: network configuration.
        shared: shared observation nodes by path (``core.specs.shared_observations(tree)``): the actor reads
            those of the group's population and its ancestors (eval-only leaves dropped), a central critic all
            of them.

    Raises:
        ValueError: every observation leaf is eval-only (the actor would see nothing), or an integer box action.
    """

    def __init__(self, group: GroupSpec, config: PolicyConfig | None = None,
                 shared: Mapping[Path, Node] | None = None) -> None:
        super().__init__()
        config = config or PolicyConfig()
        # Keep names and leaves, not the GroupSpec: spec dict nodes hold a mappingproxy, which neither
        # pickles nor deep-copies, and policies must (Ray transport, frozen opponent copies).
        self.group_name, self.config = group.name, config
        self.num_agents = a = group.capacity
        images = {"image_encoder": config.image_encoder, "image_features": config.image_features,
                  "normalize": config.normalize_observations, "leaf_encoders": dict(config.leaf_encoders)}
        self.actor_encoder = ObservationEncoder(group.agent.observation, include_eval_only=False,
                                                name=f"group {group.name}: observation", **images)
        if not self.actor_encoder.paths:
            raise ValueError(f"group {group.name}: every observation leaf is eval_only, the actor sees nothing")
        critic_paths = [p for p, _ in iter_leaves(group.agent.observation)]
        self._critic_reuses_actor_input = critic_paths == self.actor_encoder.paths
        # The critic reads the actor's encoding when it sees the same leaves (a CNN trunk is then shared, as
        # in CleanRL's Atari PPO); else it has an encoder of its own, eval-only leaves included.
        self.critic_encoder = None if self._critic_reuses_actor_input else ObservationEncoder(
            group.agent.observation, include_eval_only=True, name=f"group {group.name}: critic observation", **images)
        central = config.critic in ("central", "joint")
        #: whether the critic runs once per env with one output per agent slot (``PolicyConfig.critic="joint"``)
        self.joint_critic = config.critic == "joint"
        self.shared_encoder = SharedEncoder(shared, group.population_path) if central and shared else None
        if self.shared_encoder is not None and not self.shared_encoder.paths:
            self.shared_encoder = None
        self.heads = ActionHeads(group.agent.action, log_std_init=config.log_std_init,
                                 squash_bounded=config.squash_bounded_actions, name=f"group {group.name}: action")
        ids = a if config.agent_id_input else 0
        if ids:
            self.register_buffer("agent_ids", torch.eye(a), persistent=False)
        hidden, act, gain = config.hidden_sizes, config.activation, config.hidden_gain

        actor_shared = SharedEncoder(shared, group.population_path, include_eval_only=False) if shared else None
        #: the actor's encoder of shared observations (None: it reads none)
        self.actor_shared_encoder = actor_shared if actor_shared is not None and actor_shared.paths else None
        actor_in = self.actor_encoder.out_features + ids + (
            self.actor_shared_encoder.out_features if self.actor_shared_encoder is not None else 0)
        self.actor_trunk = mlp(actor_in, hidden, act, gain)
        width = hidden[-1] if hidden else actor_in
        #: whether the policy carries a recurrent state (``config.recurrent``)
        self.recurrent = config.recurrent
        # Cells are registered as "gru"/"lstm" and "critic_gru"/"critic_lstm": a GRU policy's weights keep the
        # names they had before LSTMs existed, so its checkpoints still load.
        self._actor_cell = self._critic_cell = None
        if config.recurrent:
            self._actor_cell = config.recurrent_cell
            setattr(self, self._actor_cell, make_cell(config.recurrent_cell, width, config.recurrent_size))
            width = config.recurrent_size
        self.actor_out = init_linear_(OutputLinear(width, self.heads.num_params), config.actor_output_gain)

        f_c = (self.critic_encoder or self.actor_encoder).out_features
        every = a * f_c + (self.shared_encoder.out_features if self.shared_encoder is not None else 0)
        critic_in = {"local": f_c + ids, "central": f_c + every + ids, "joint": every}[config.critic]
        self.critic_trunk = mlp(critic_in, hidden, act, gain)
        width = hidden[-1] if hidden else critic_in
        if config.recurrent_critic:
            self._critic_cell = f"critic_{config.recurrent_cell}"
            setattr(self, self._critic_cell, make_cell(config.recurrent_cell, width, config.recurrent_size))
            width = config.recurrent_size
        self.critic_out = init_linear_(OutputLinear(width, a if self.joint_critic else 1), config.critic_output_gain)
        sizes = [state_size(getattr(self, c)) for c in (self._actor_cell, self._critic_cell) if c is not None]
        #: width ``S`` of the carried state: the actor cell's part, then the critic cell's (0: feed-forward)
        self.state_size = sum(sizes)
        self._state_split = sizes
        #: running return statistics (config.scale_rewards): updated and applied by learners only
        self.reward_scaler = RewardScaler() if config.scale_rewards else None
        # The common acting case (one flat float observation leaf, feed-forward, no agent ids, one discrete action
        # leaf) as (observation width, actor layers, head): act_step then runs the layers and the head directly,
        # skipping ~10 Python calls of the general path. Inside a gymnasium loop, where the env's own Python
        # evicts the interpreter's caches between steps, that saved ~20 µs per 64-env CartPole step (with the
        # actor's matching shortcut, orchestration.actor). Same ops, same results.
        #: whether ``act_step(with_log_prob=False)`` returns the head params for a later, per-fragment log-probability
        #: (:meth:`log_prob_from_params`): heads that recompute it exactly, with few params (an actor stores the
        #: params of every step: ``[E, A, num_params]`` instead of ``[E, A, 1]``)
        self.defers_log_prob = self.heads.exact_log_prob and self.heads.num_params <= _DEFER_MAX_PARAMS
        head = self.heads.heads[0]
        lean = (self.actor_encoder._plain is not None and not self.recurrent and not ids
                and self.actor_shared_encoder is None
                and self.heads.paths == [()] and isinstance(head, CategoricalHead))
        self._lean = (self.actor_encoder._plain, (*self.actor_trunk, self.actor_out), head) if lean else None

    # ----------------------------------------------------------------------------------------- tensor core
    def _with_ids(self, x: Tensor) -> Tensor:
        if not self.config.agent_id_input:
            return x
        return torch.cat([x, self.agent_ids.expand(*x.shape[:-1], self.num_agents)], -1)

    def actor_hidden(self, features: Tensor, shared=None) -> Tensor:
        """The actor trunk's output ``[*B, A, F_h]`` (before the cell): ``features`` ``[*B, A, F]`` (the own
        observation's encoding), the slot ids and the encoded ``shared`` entry ``[*B, ...]`` if the actor reads it."""
        x = self._with_ids(features)
        if self.actor_shared_encoder is not None:
            if shared is None:
                raise ValueError(f"group {self.group_name}: the actor reads the shared observations "
                                 f"{['/'.join(p) for p in self.actor_shared_encoder.paths]}; pass the step's "
                                 f"'shared' entry (or tag them eval_only)")
            s = self.actor_shared_encoder(shared)
            x = torch.cat([x, s.unsqueeze(-2).expand(*x.shape[:-1], -1)], -1)
        return run_layers(self.actor_trunk, x)

    def actor_params(self, features: Tensor, state: Tensor | None = None, shared=None) -> tuple[Tensor, Tensor | None]:
        """Action-head parameters ``[*B, A, num_params]`` and the actor cell's next state (None if feed-forward).

        Args:
            features: ``self.actor_encoder(leaves)``, ``[*B, A, F]``.
            state: the actor cell's part of the state, ``[*B, A, S_actor]`` (required when recurrent).
            shared: the step's ``"shared"`` entry ``[*B, ...]`` (required when the actor reads shared observations).
        """
        h = self.actor_hidden(features, shared)
        if self._actor_cell is not None:
            if state is None:
                raise ValueError(f"group {self.group_name}: a recurrent policy needs a recurrent_state [*B, A, S]")
            h, state = cell_step(self.actor_cell, h, state)
        return self.actor_out.forward(h), state

    def _value(self, obs, shared, actor_features: Tensor | None, state: Tensor | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """``(value [*B, A, 1], the critic cell's next state or None)``; ``state``: its part of the state."""
        h = run_layers(self.critic_trunk, self._critic_input(obs, shared, actor_features))
        if self._critic_cell is not None:
            h, state = cell_step(self.critic_cell, h, state)
        return self._critic_output(h), state

    def _critic_output(self, h: Tensor) -> Tensor:
        """``state_value`` ``[*B, A, 1]`` from the critic trunk's output (``[*B, F_h]`` for a joint critic)."""
        return self.critic_out.forward(h).unsqueeze(-1) if self.joint_critic else self.critic_out.forward(h)

    def _critic_input(self, obs, shared, actor_features: Tensor | None) -> Tensor:
        """The critic trunk's input: ``[*B, A, F_c]``, or ``[*B, F_c]`` for a joint critic (module docstring)."""
        if actor_features is not None and self._critic_reuses_actor_input:
            own = actor_features
        else:
            own = (self.critic_encoder or self.actor_encoder).encode(obs[OBSERVATION])
        if self.config.critic == "local":
            return self._with_ids(own)
        present = obs.get(CRITIC_MASK, None)  # the agents present, where MASK holds only the trained slots
        present = obs.get(MASK, None) if present is None else present
        if self.shared_encoder is not None and shared is None:
            raise ValueError(f"group {self.group_name}: the {self.config.critic} critic needs the shared observation")
        s = None if self.shared_encoder is None else self.shared_encoder(shared)
        if self.joint_critic:  # alike for every agent of an env: one row per env
            return joint_input(own, present, s)
        return self._with_ids(central_input(own, present, s))

    def _features(self, obs) -> Tensor:
        x = self.actor_encoder.encode(obs[OBSERVATION])
        if x.dim() < 2 or x.shape[-2] != self.num_agents:
            raise ValueError(f"group {self.group_name}: observation batch {tuple(x.shape[:-1])} must end with "
                             f"the agent dim {self.num_agents}")
        return x

    # ------------------------------------------------------------------------------------------ public API
    def act_step(self, obs, shared=None, generator: torch.Generator | None = None, deterministic: bool = False,
                 recurrent_state: Tensor | None = None, episode_start: Tensor | None = None,
                 with_value: bool = True, with_log_prob: bool = True) -> dict:
        """:meth:`act` returning a plain nested dict (no TensorDict built: ~1 µs instead of ~40, pattern 1).

        ``obs`` may be a TensorDict or a nested dict of tensors with the same keys. ``with_value=False`` skips
        the critic (a learner that evaluates values for the whole batch at once does not need them per step).
        ``with_log_prob=False``: when :attr:`defers_log_prob` (heads that recompute it exactly, few params), the
        output carries the head parameters ``"action_params"`` ``[E, A, heads.num_params]`` instead of
        ``"log_prob"``; :meth:`log_prob_from_params` turns them into the same log-probabilities later, for a
        whole fragment in one call (per step, the log-softmax and gather cost an actor ~2-4% of a CartPole
        step). Other policies still return ``"log_prob"``.
        Runs without gradients (a caller already in ``torch.no_grad()`` saves entering it again per step).
        """
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.act_step(obs, shared, generator, deterministic, recurrent_state, episode_start,
                                     with_value, with_log_prob)
        if self._lean is not None and not with_value and (deterministic or generator is not None):
            out = self._lean_act(obs, generator, deterministic, with_log_prob)
            if out is not None:
                return out
        x = self._features(obs)
        state = actor_state = critic_state = None
        if self.recurrent:
            state = self.initial_state(x.shape[:-2]) if recurrent_state is None else recurrent_state
            if episode_start is not None:
                keep = ~episode_start
                keep = keep.reshape(*keep.shape, *(1,) * (state.dim() - keep.dim()))
                state = torch.where(keep, state, torch.zeros((), dtype=state.dtype, device=state.device))
            actor_state, critic_state = self.split_state(state)
        params, next_state = self.actor_params(x, actor_state, shared)
        mask = obs.get(ACTION_MASK, None)
        defer = not with_log_prob and self.defers_log_prob
        if deterministic:
            actions = self.heads.mode(params, mask)
            log_prob = None if defer else self.heads.log_prob(params, actions, mask)
        else:
            if generator is None:
                raise ValueError("sampling needs a torch.Generator (randomness is an argument)")
            if defer:
                actions, log_prob = self.heads.sample_actions(params, generator, mask), None
            else:
                actions, log_prob = self.heads.sample(params, generator, mask)
        out = {ACTION: self.heads.as_tree(actions)}
        if defer:
            out[ACTION_PARAMS] = params
        else:
            out[LOG_PROB] = log_prob
        if with_value or critic_state is not None:  # a recurrent critic advances its state at every step
            value, critic_state = self._value(obs, shared, x, critic_state)
            if with_value:
                out[STATE_VALUE] = value
        if self.recurrent:
            out[RECURRENT_STATE] = state
            out[NEXT] = {RECURRENT_STATE: next_state if critic_state is None else torch.cat((next_state, critic_state), -1)}
        return out

    def _lean_act(self, obs, generator, deterministic: bool, with_log_prob: bool) -> dict | None:
        """:meth:`act_step` for the case of ``_lean`` (see ``__init__``), or None for an input it does not take."""
        width, layers, head = self._lean
        x = obs[OBSERVATION]
        if not isinstance(x, Tensor) or x.dtype != torch.float32 or x.dim() < 2 or x.shape[-1] != width \
                or x.shape[-2] != self.num_agents:
            return None  # the general path converts or reports it
        for layer in layers:
            x = layer.forward(x)
        mask = obs.get(ACTION_MASK, None)
        defer = not with_log_prob and self.defers_log_prob
        if deterministic:
            action = head.mode(x, mask)
            return {ACTION: action, ACTION_PARAMS: x} if defer else \
                {ACTION: action, LOG_PROB: head.log_prob(x, action, mask)}
        if defer:
            return {ACTION: head.sample_action(x, generator, mask), ACTION_PARAMS: x}
        action, log_prob = head.sample(x, generator, mask)
        return {ACTION: action, LOG_PROB: log_prob}

    def act(self, obs, shared=None, generator: torch.Generator | None = None, deterministic: bool = False,
            recurrent_state: Tensor | None = None, episode_start: Tensor | None = None) -> TensorDict:
        """Actions for every agent of every env, without gradients (runs under ``torch.no_grad()`` itself).

        Args:
            obs: the group's entry of a step, batch ``[E, A]`` (any ``[*B, A]``): ``"observation"`` (leaf or
                tree), optional ``"action_mask"`` ``[E, A, n]`` bool (illegal actions are never sampled),
                optional ``"mask"`` ``[E, A]`` (read by a central critic: absent agents are zeroed).
            shared: the step's ``"shared"`` entry ``[E, ...]``; required by an actor or a central critic that
                reads shared observations.
            generator: the only source of randomness (unused when ``deterministic``).
            deterministic: act with the mode (masked argmax, Gaussian mean).
            recurrent_state: GRU state ``[E, A, H]`` from the previous step's ``("next", "recurrent_state")``;
                None means zeros.
            episode_start: bool ``[E]`` or ``[E, A]``: rows whose state is zeroed first (new episodes).

        Returns:
            TensorDict ``[E, A]``: ``"action"`` (leaf tensor or sub-TensorDict, as in the spec), ``"log_prob"``
            ``[E, A, 1]``, ``"state_value"`` ``[E, A, 1]``; when recurrent also ``"recurrent_state"`` (the
            state this step used: store it) and ``("next", "recurrent_state")`` (feed it to the next step).
        """
        check_group_entry(obs, self.group_name, "act")
        out = self.act_step(obs, shared, generator, deterministic, recurrent_state, episode_start)
        return TensorDict(out, batch_size=out[LOG_PROB].shape[:-1])

    def evaluate(self, batch, shared=None) -> TensorDict:
        """Differentiable log-probability, entropy and value of stored actions, for the PPO loss.

        Args:
            batch: a group entry ``[N, A]`` (any ``[*B, A]``): ``"observation"``, ``"action"``, optional
                ``"action_mask"``, ``"mask"`` (central critic) and, when recurrent, ``"recurrent_state"``
                (the state stored by :meth:`act`; truncated BPTT of length 1, see the module docstring).
            shared: the root ``"shared"`` entry ``[N, ...]`` of the same minibatch (central critic).

        Returns:
            TensorDict ``[N, A]`` with ``"log_prob"``, ``"entropy"``, ``"state_value"``, each ``[N, A, 1]``.
        """
        check_group_entry(batch, self.group_name, "evaluate")
        out = self.evaluate_terms(batch, shared)
        return TensorDict(out, batch_size=out[LOG_PROB].shape[:-1])

    def evaluate_terms(self, batch, shared=None) -> dict[str, Tensor]:
        """:meth:`evaluate` as a plain dict (the learner's per-minibatch path: no container built)."""
        x = self._features(batch)
        actor_state = critic_state = None
        if self.recurrent:
            actor_state, critic_state = self.split_state(batch.get(RECURRENT_STATE))
        params, _ = self.actor_params(x, actor_state, shared)
        return self._terms(batch, params, self._value(batch, shared, x, critic_state)[0])

    def _terms(self, batch, params: Tensor, value: Tensor) -> dict[str, Tensor]:
        lead = params.shape[:-1]
        actions = [read_path(batch, (ACTION, *p)) for p in self.heads.paths]
        for path, a in zip(self.heads.paths, actions):
            if a.shape[: len(lead)] != lead:
                raise ValueError(f"action {'/'.join(path) or '<leaf>'} {tuple(a.shape)} must start with {tuple(lead)}")
        log_prob, entropy = self.heads.log_prob_entropy(params, actions, batch.get(ACTION_MASK, None))
        return {LOG_PROB: log_prob, ENTROPY: entropy, STATE_VALUE: value}

    @torch.no_grad()
    def log_prob_from_params(self, params: Tensor, action, action_mask: Tensor | None = None) -> Tensor:
        """Log-probability ``[*B, A, 1]`` of ``action`` from the ``"action_params"`` that :meth:`act_step` returned
        with ``with_log_prob=False`` (any leading dims, e.g. a fragment's ``[E, T]``): bit for bit the value
        ``act_step`` would have returned.

        Args:
            params: ``[*B, A, heads.num_params]``.
            action: the action (leaf tensor or tree) sampled with them, ``[*B, A, *act]``.
            action_mask: the ``[*B, A, n]`` mask they were sampled with, if any.
        """
        if not self.heads.exact_log_prob:
            raise ValueError(f"group {self.group_name}: its action heads cannot recompute log-probabilities")
        return self.heads.log_prob(params, [read_path(action, p) for p in self.heads.paths], action_mask)

    @torch.no_grad()
    def observe_(self, observation, mask: Tensor | None = None, reduce=None) -> None:
        """Updates the observation normalisers (``PolicyConfig.normalize_observations``) with ``observation``
        ``[*B, A, *obs]`` where ``mask`` ``[*B, A]`` (``reduce``: ObservationEncoder.observe_'s); no-op without."""
        for encoder in (self.actor_encoder, self.critic_encoder):
            if encoder is not None and encoder.normalized:
                encoder.observe_(observation, mask, reduce)

    @torch.no_grad()
    def value(self, obs, shared=None) -> Tensor:
        """Critic value ``[*B, A, 1]`` without gradients (bootstrapping ``("next", group)`` observations) of a
        feed-forward critic (a recurrent one needs its state: :meth:`sequence_values`)."""
        if self._critic_cell is not None:
            raise ValueError(f"group {self.group_name}: a recurrent critic's values need its state; use sequence_values")
        return self._value(obs, shared, None)[0]


def make_policies(tree: Tree, config: PolicyConfig | None = None) -> dict[str, GroupPolicy]:
    """One :class:`GroupPolicy` per group of ``tree`` (the default mapping: agents of a group share one)."""
    shared = shared_observations(tree)
    if config is not None and config.leaf_encoders:  # every override must name a leaf of some group
        check_leaf_names([leaf for leaf, _ in config.leaf_encoders],
                         [p for g in groups(tree).values() for p, _ in iter_leaves(g.agent.observation)])
    return {name: GroupPolicy(g, config, shared) for name, g in groups(tree).items()}


__all__ = ["ENTROPY", "GroupPolicy", "make_policies"]
