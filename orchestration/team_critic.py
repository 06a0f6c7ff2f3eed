"""A centralised critic shared by a team, as a learner of its own (issue 14: learners that yield data).

A **team** is one population of the env's tree (:attr:`core.specs.GroupSpec.population_path`: the agents of its
groups, nested populations excluded) whose payoff is not zero-sum (its agents share a reward structure) and in
which at least two learning policies act: a heterogeneous team, e.g. ``builtin:spread`` with ``--policy-mapping
agents_0 a agents_1 b agents_2 c``. Without a team critic each of those policies trains a critic of its own on
its own agents' data; :class:`TeamCriticLearner` trains one value network per team on the whole team's data.

Its input (:class:`TeamValueNet`) is centralised: every agent's observation of every group of the team
(eval-only leaves included, absent agents zeroed) with its presence bit, in group then slot order, and the
shared observations of the population and its ancestors when the env has them (``builtin:spread``'s state),
as the env gives them (no running normalisation); its output is one value per agent slot of the team
(``[*B, A_g, 1]`` per group): rewards may differ per agent.

The sync loop (:class:`orchestration.trainer.Trainer`), on both backends::

    critic.receive(fragment, meta)              # the fleet delivers every fragment to it, as to the learners
    values = critic.values()                    # the fresh batch's values and next values, per fragment id,
                                                # under the critic's current weights (a Ray ref on Ray)
    member.submit(progress, lr, take_all=True, team_values=values)   # GAE with them; value loss off
    critic.submit(progress, lr)                 # trains on the batch's team returns (in parallel on Ray)

Its targets are the GAE(lambda) returns the members' advantages come from (same rewards after
:func:`core.losses.credit_absent_steps`, same gamma and lambda, :func:`core.losses.with_gae`); its loss is PPO's
value loss (:func:`core.losses.value_loss`, clipped with ``ppo.value_clip_eps``), ``ppo.num_epochs`` x minibatches
of ``ppo.minibatch_size`` transitions, gradient norm clipped to ``ppo.max_grad_norm``. State (:meth:`state`) as
a PPO learner's: weights, optimizer, generator, version, counters and the inbox ledger.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from core.buffers import concat_fragments, flatten_transitions
from core.buffers.batching import gathered_minibatches
from core.layout import MASK, NEXT, OBSERVATION, SHARED, STATE_VALUE, VALUE_TARGET
from core.losses import PPOConfig, credit_absent_steps, mixed_precision, value_loss, with_gae
from core.policies import PolicyConfig
from core.policies.networks import ObservationEncoder, OutputLinear, SharedEncoder, init_linear_, mlp
from core.specs import GroupSpec, Tree, groups, shared_observations
from orchestration.checkpoint import flatten_optimizer, restore_optimizer
from orchestration.inbox import Inbox
from orchestration.learner import Done
from orchestration.team_critic_config import TeamCriticConfig

#: The team critic's key among the fleet's receivers (not a policy id: it never acts).
TEAM_CRITIC = "<team-critic>"


@dataclass(frozen=True)
class Team:
    """The agents of one population that share a critic."""

    population: str
    """The population's path in the tree (``""``: the root)."""
    groups: tuple[str, ...]
    """Its groups, in tree order."""
    policies: tuple[str, ...]
    """The learning policies acting in it (>= 2): their learners take the team's values."""


def teams_for(config, tree: Tree, assignment: Mapping[str, Any], learning: Collection[str]) -> list[Team]:
    """The teams of a run with ``--team-critic.enabled`` (module docstring); ``[]`` when it is off.

    Args:
        config: the run's :class:`orchestration.config.TrainConfig`.
        tree: the env's tree.
        assignment: group -> :class:`orchestration.assignment.GroupAssignment`.
        learning: the learning policy ids.

    Raises:
        ValueError: a combination the team critic does not support, or an env without a team, naming the flag.
    """
    if not config.team_critic.enabled:
        return []
    flag = "--team-critic.enabled"
    for bad, why in ((config.mode != "sync", "needs --mode sync (its values must reach the members' batch "
                      "before they train); train synchronously or leave it off"),
                     (config.env == "external", "does not run with --env external yet (external simulators "
                      "bring their tree when they connect); use --policy.critic central (or joint) instead"),
                     (config.curiosity.enabled, "cannot be combined with --curiosity.coef > 0 (the bonus is "
                      "per policy, the team's returns would differ per member); set --curiosity.coef 0"),
                     (config.policy.scale_rewards, "cannot be combined with --policy.scale-rewards (each member "
                      "scales its rewards by its own statistics); leave reward scaling off"),
                     (config.policy.recurrent_critic, "has no recurrent form: drop --policy.recurrent-critic (a "
                      "recurrent actor is fine)"),
                     (config.ray.learners_per_policy > 1, "does not shard its values over data-parallel ranks: "
                      "use --ray.learners-per-policy 1"),
                     (config.ppo.advantage != "gae", "trains on GAE(lambda) targets of on-policy batches, which "
                      "the members' advantages must match: use --ppo.advantage gae (V-trace is for lagging data)")):
        if bad:
            raise ValueError(f"{flag} {why}.")
    specs, teams, seen, mates = groups(tree), [], [], []
    for path in dict.fromkeys(s.population_path for s in specs.values()):
        names = tuple(g for g, s in specs.items() if s.population_path == path)
        pids = tuple(dict.fromkeys(p for g in names for p in assignment[g].policies if p in learning))
        payoff = specs[names[0]].payoff
        seen.append(f"population {path or '(root)'!r} ({payoff}, groups {list(names)}, learning policies "
                    f"{list(pids)})")
        if payoff != "zero_sum" and len(pids) >= 2:
            teams.append(Team(path, names, pids))
        elif payoff != "zero_sum":
            mates += [a for g in names for a in specs[g].agent_names]
    if not teams:
        how = (f"Map the team's agents to different policies (e.g. --policy-mapping {mates[0]} a {mates[1]} b) or, "
               f"for one shared policy, use --policy.critic central (or joint) instead" if len(mates) >= 2 else
               "A team is two or more agents of a population that is not zero-sum, and this env has none")
        raise ValueError(f"{flag}: the env has no team to share a critic: a team is a population that is not "
                         f"zero-sum with at least two learning policies acting in it, and here there are "
                         f"{'; '.join(seen)}. {how}.")
    return teams


class TeamValueNet(nn.Module):
    """The value network of one team: ``[*B]`` roots in, one value per agent slot out (module docstring)."""

    def __init__(self, specs: Sequence[GroupSpec], shared: Mapping, population: str, hidden: Sequence[int],
                 policy: PolicyConfig) -> None:
        super().__init__()
        self.groups = [s.name for s in specs]
        self.capacities = [s.capacity for s in specs]
        self.encoders = nn.ModuleList(ObservationEncoder(
            s.agent.observation, include_eval_only=True, name=f"group {s.name}: team critic observation",
            image_encoder=policy.image_encoder, image_features=policy.image_features) for s in specs)
        self.shared = SharedEncoder(shared, population) if shared else None
        if self.shared is not None and not self.shared.paths:
            self.shared = None
        width = sum(a * (e.out_features + 1) for a, e in zip(self.capacities, self.encoders))
        width += self.shared.out_features if self.shared is not None else 0
        self.trunk = mlp(width, hidden, policy.activation, policy.hidden_gain)
        self.out = init_linear_(OutputLinear(hidden[-1] if hidden else width, sum(self.capacities)), 1.0)

    def forward(self, root: TensorDictBase) -> dict[str, Tensor]:
        """Group -> values ``[*B, A, 1]`` of the root ``root`` ``[*B]`` (its groups' ``observation`` and
        ``mask``, and ``"shared"`` when the team reads shared observations)."""
        parts = []
        for name, encoder in zip(self.groups, self.encoders):
            g = root.get(name)
            x = encoder.encode(g.get(OBSERVATION))                                  # [*B, A, F]
            present = g.get(MASK, None)
            present = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device) if present is None else present
            x = torch.where(present.unsqueeze(-1), x, 0.0)  # where, not multiply: padding may hold NaN
            parts += [x.flatten(-2), present.to(x.dtype)]
        if self.shared is not None:
            parts.append(self.shared(root.get(SHARED)))
        values = self.out(self.trunk(torch.cat(parts, -1))).split(self.capacities, -1)
        return {name: v.unsqueeze(-1) for name, v in zip(self.groups, values)}


class TeamCriticLearner:
    """The critics of every team and their one optimizer (module docstring).

    Args:
        tree: the env's tree.
        teams: :func:`teams_for`'s teams.
        critic: its settings (hidden sizes, learning rate).
        policy: activation, initialisation and image encoders of the networks.
        ppo: gamma, lambda, epochs, minibatch size, value clipping and gradient clipping.
        lr: the run's learning rate (the critic's unless ``critic.lr`` is set; annealing follows its ratio).
        batch_steps: env steps of a training batch.
        seed: seeds the initial weights (without touching the global generator) and the minibatch order.
        device: where the critic trains.
    """

    def __init__(self, tree: Tree, teams: Sequence[Team], *, critic: TeamCriticConfig, policy: PolicyConfig,
                 ppo: PPOConfig, lr: float, batch_steps: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.teams, self.ppo, self.device = list(teams), ppo, torch.device(device)
        self.run_lr, self.lr = lr, critic.lr or lr
        specs, shared = groups(tree), shared_observations(tree)
        with torch.random.fork_rng(devices=[]):  # the initial weights are a function of the seed alone
            torch.manual_seed(seed + 0x7EA)
            self.nets = nn.ModuleList(TeamValueNet([specs[g] for g in t.groups], shared, t.population,
                                                   critic.hidden_sizes, policy) for t in self.teams).to(self.device)
        self.optimizer = torch.optim.Adam(self.nets.parameters(), lr=self.lr, eps=1e-5)
        self.generator = torch.Generator().manual_seed(seed + 0x7EA)
        self.inbox = Inbox(TEAM_CRITIC, batch_steps)
        self.version = 0
        self.counters = {"fragments_received": 0, "env_steps_trained": 0, "train_steps": 0}
        self.batch: TensorDictBase | None = None
        """The batch whose values :meth:`values` handed out last, with them; :meth:`train` trains on it."""

    @property
    def members(self) -> set[str]:
        """Every team's learning policies."""
        return {p for t in self.teams for p in t.policies}

    # -- data in -----------------------------------------------------------------------------------------
    def receive(self, fragment: TensorDictBase, meta: Mapping[str, Any]) -> str | None:
        """Files a fragment ``[E, T]`` (as :meth:`orchestration.learner.PPOLearner.receive`); the critic's version at
        arrival stands for the policy version its ledger reads (it has no actors)."""
        return self.file(fragment, meta) if self.inbox.announce(meta) else None

    def file(self, fragment: TensorDictBase, meta: Mapping[str, Any]) -> str:
        """:meth:`receive` of a fragment the inbox has announced already (a Ray push)."""
        self.counters["fragments_received"] += 1
        meta = {**meta, "policy_versions": {**meta.get("policy_versions", {}), TEAM_CRITIC: self.version}}
        return self.inbox.add(fragment, meta, self.version)

    def settle(self, produced: Mapping[int, int]) -> int:
        """Counts as lost what the workers produced and never delivered here."""
        return self.inbox.settle(produced)

    # -- data out ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def values(self) -> dict[int, TensorDict]:
        """Takes every fresh fragment and returns, per fragment id, its values under the current weights:
        ``(group, "state_value")`` and ``("next", group, "state_value")`` ``[E_i, T, A, 1]`` of every team
        group (CPU). Keeps the batch for :meth:`train`."""
        entries = self.inbox.take(self.version, take_all=True)
        if not entries:
            self.batch = None
            return {}
        batch = concat_fragments([e.fragment for e in entries]).to(self.device)
        out = TensorDict({NEXT: TensorDict(batch_size=batch.batch_size)}, batch_size=batch.batch_size)
        for net in self.nets:
            for root, where in ((batch, out), (batch.get(NEXT), out.get(NEXT))):
                for name, value in net(root).items():
                    where.set((name, STATE_VALUE), value)
        self.batch = batch.update(out.to(self.device))
        rows = [e.fragment.batch_size[0] for e in entries]
        return {int(e.meta["fragment_id"]): part for e, part in zip(entries, out.cpu().split(rows, 0))}

    # -- training ----------------------------------------------------------------------------------------
    def targets(self, batch: TensorDictBase) -> TensorDictBase:
        """``batch`` with ``(group, "value_target")`` of every team group: the GAE(lambda) returns of its
        (absent-credited) rewards under the values it carries."""
        for team in self.teams:
            for name in team.groups:
                batch = with_gae(credit_absent_steps(batch, name), name, self.ppo.gamma, self.ppo.gae_lambda)
        return batch

    def train(self, progress: float = 0.0, lr: float | None = None) -> dict[str, float]:
        """Epochs x minibatches of value-loss SGD on the batch of the last :meth:`values` (``{}`` without one);
        ``lr``: the run's current learning rate (the critic's follows its ratio to the run's)."""
        if self.batch is None:
            return {}
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = self.lr * lr / self.run_lr
        batch, self.batch = self.targets(self.batch), None
        data = flatten_transitions(batch.exclude(NEXT))
        rows: list[Tensor] = []
        params, skipped = list(self.nets.parameters()), 0
        precision = mixed_precision(self.device, self.ppo.compute_dtype) or contextlib.nullcontext
        for _ in range(self.ppo.num_epochs):
            for mb in gathered_minibatches(data, self.ppo.minibatch_size, self.generator):
                with precision():
                    outs = [net(mb) for net in self.nets]
                terms = [value_loss(values.float(), mb.get((name, STATE_VALUE)), mb.get((name, VALUE_TARGET)),
                                    mb.get((name, MASK), None), self.ppo.value_clip_eps)
                         for out in outs for name, values in out.items()]
                loss = sum(t["loss_value"] for t in terms)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(params, self.ppo.max_grad_norm or math.inf)
                if not (torch.isfinite(loss) and torch.isfinite(norm)):  # PPO's guard: skip, weights untouched
                    skipped += 1
                    continue
                self.optimizer.step()
                rows.append(torch.stack([loss.detach(), norm.detach(),
                                         torch.stack([t["explained_variance"] for t in terms]).nanmean()]))
        self.version += 1
        self.counters["train_steps"] += 1
        self.counters["env_steps_trained"] += batch.batch_size.numel()
        mean = torch.stack(rows).nanmean(0).tolist() if rows else [math.nan] * 3
        return {"loss_value": mean[0], "grad_norm": mean[1], "explained_variance": mean[2],
                "version": float(self.version), "skipped_steps": float(skipped)}

    def submit(self, progress: float = 0.0, lr: float | None = None) -> Done:
        """Trains now (:meth:`train`); the result: ``{"metrics", "version"}``."""
        return Done({"metrics": self.train(progress, lr), "version": self.version})

    # -- state -------------------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The inbox's ledger and counters, this critic's counters and version."""
        return {**self.inbox.report(), "learner": dict(self.counters), "version": self.version}

    def state(self) -> dict[str, Any]:
        """Weights, optimizer, generator, version, counters and the inbox ledger (numpy arrays and JSON)."""
        tensors, meta = flatten_optimizer("optimizer", self.optimizer)
        return {"weights": {k: _numpy(v) for k, v in self.nets.state_dict().items()},
                "optimizer": ({k: _numpy(v) for k, v in tensors.items()}, meta),
                "generator": _numpy(self.generator.get_state()), "version": self.version,
                "counters": dict(self.counters), "inbox": self.inbox.state()}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state` (mutates this critic); without ``"inbox"`` the ledger starts fresh."""
        self.nets.load_state_dict({k: _tensor(v) for k, v in state["weights"].items()})
        tensors, meta = state["optimizer"]
        restore_optimizer("optimizer", self.optimizer, {k: _tensor(v) for k, v in tensors.items()}, meta)
        self.generator.set_state(_tensor(state["generator"]))
        self.version = int(state["version"])
        self.counters.update(state["counters"])
        if "inbox" in state:
            self.inbox.load_state_(state["inbox"])
        self.batch = None


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _tensor(array) -> Tensor:  # np.array: a writable copy of a possibly read-only view
    return array.clone() if isinstance(array, Tensor) else torch.from_numpy(np.array(array))


def team_critic_settings(config) -> dict[str, Any]:
    """The keyword arguments of :class:`TeamCriticLearner` that a run's config sets (every backend's)."""
    from orchestration.devices import resolve_device

    return {"critic": config.team_critic, "policy": config.policy, "ppo": config.ppo, "lr": config.lr,
            "batch_steps": config.steps_per_iteration, "seed": config.seed, "device": resolve_device(config.device)}


def build_team_critic(config, tree: Tree, teams: Sequence[Team]) -> TeamCriticLearner | None:
    """The run's local :class:`TeamCriticLearner` (None without teams)."""
    return TeamCriticLearner(tree, teams, **team_critic_settings(config)) if teams else None


__all__ = ["TEAM_CRITIC", "Team", "TeamCriticConfig", "TeamCriticLearner", "TeamValueNet", "build_team_critic",
           "team_critic_settings", "teams_for"]
