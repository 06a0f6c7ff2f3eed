"""The team critic's settings (``--team-critic.*``): kept apart from :mod:`orchestration.config` so that its
flags parse without importing torch, like every other config."""

from __future__ import annotations

from dataclasses import dataclass

from orchestration.config_kinds import check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class TeamCriticConfig:
    """One value network per team, shared by the team's policies (:mod:`orchestration.team_critic`).

    A team is one population of the env's tree (its agents share a payoff structure: cooperative or general-sum,
    not zero-sum) in which at least two learning policies act, e.g. ``builtin:spread`` with ``--policy-mapping
    agents_0 a agents_1 b agents_2 c``. Its critic reads every member's observation (eval-only leaves
    included, absent agents zeroed, presence bits) and the shared observations of the population and its
    ancestors, and outputs one value per agent slot. Each iteration it hands the values of the batch to the
    member policies' PPO learners, which compute their GAE advantages with them instead of their own critics
    (whose value loss is then off), and trains itself on the team's returns: PPO's value loss (clipped with
    ``--ppo.value-clip-eps``), ``--ppo.num-epochs`` x minibatches of ``--ppo.minibatch-size``, gradient norm
    clipped to ``--ppo.max-grad-norm``. Synchronous mode only.
    """

    enabled: bool = False
    """Train a team critic for every team of the env (``--team-critic.enabled``)."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Widths of the critic's hidden layers (activation and initialisation as ``--policy.*`` says)."""
    lr: float | None = None
    """Adam learning rate of the critic; None: the run's ``--lr`` (annealed with it when ``--anneal-lr``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.hidden_sizes, tuple) or not all(isinstance(h, int) and h >= 1 for h in self.hidden_sizes):
            raise ValueError(f"TeamCriticConfig.hidden_sizes (--team-critic.hidden-sizes) must be a tuple of ints "
                             f">= 1, got {self.hidden_sizes!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"TeamCriticConfig.lr (--team-critic.lr) must be > 0 or None, got {self.lr!r}")


__all__ = ["TeamCriticConfig"]
