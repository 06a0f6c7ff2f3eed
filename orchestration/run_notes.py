"""What a run says on stderr about its own settings before it trains: settings given that it does not use (past
selves no policy can take among them), iterations past the learning rate's annealing horizon, and what a resume's
flags change (``shoal train``, ``shoal serve``, ``shoal league``)."""

from __future__ import annotations

import sys
from typing import Mapping

from orchestration.config import TrainConfig


class UnusedSettingWarning(UserWarning):
    """A setting given (unlike its default) that the run does not use (:func:`unused_settings`): warned by
    :func:`orchestration.builder.build_trainer`; the ``shoal`` commands say it on stderr instead."""


def note_unused(command: str, config: TrainConfig, base: TrainConfig | None = None) -> None:
    """Names on stderr the settings given (unlike their defaults) that this run does not use: never silently.
    ``base``: a resumed run's saved config, whose settings were the user's at the start (only flags changing
    them now are news)."""
    for sentence in unused_settings(config, base):
        print(f"shoal {command}: {sentence}", file=sys.stderr)
    note_capped(command, config)


def unused_settings(config: TrainConfig, base: TrainConfig | None = None) -> list[str]:
    """One sentence per group of settings given (unlike their defaults, or unlike ``base``'s: a resumed run's
    saved config) that a run of ``config`` does not use (the Ray backend's on a local run, async-only ones on a
    synchronous run, ...), naming them as flags."""
    sentences = []
    every, feed_forward = None, "recurrent policies only (--policy.recurrent); this run's is feed-forward"
    ray_fields = [f for f in config.ray.__dataclass_fields__  # the iteration timeout guards async runs anywhere
                  if not (config.mode == "async" and f == "iteration_timeout_s")]
    for section, unused, what, fields in (
            ("ray", config.backend == "local", "--backend ray only; this run is local", ray_fields),
            ("", config.backend == "local", "--backend ray only; this run is local", ("address",)),
            ("", config.mode == "sync", "--mode async only; this run is synchronous", ("max_staleness", "reuse_limit")),
            ("external", config.env != "external", f"--env external only; this run trains {config.env}", every),
            ("rollout", config.env == "external", "envs Shoal steps itself; this run trains on external simulators",
             ("env_processes", "env_timeout_s", "check", "env_polling")),
            ("external", config.env == "external" and not config.external.command,
             "simulators launched by --external.command; this run launches none",
             ("instances", "max_restarts", "restart_backoff_s")),  # start_timeout_s: the wait for the first one
            ("", config.collection is not None, "runs without --collection only; this run trains the collection's "
             "envs", ("env", "env_kwargs")),
            ("", config.env == "external", "envs Shoal builds itself; external simulators bring their own",
             ("env_kwargs",)),
            ("team_critic", not config.team_critic.enabled, "--team-critic.enabled only; this run has no team critic",
             every),
            ("pretrain", not config.pretrain.dataset, "runs with --pretrain.dataset only; this run has none", every),
            ("", not config.eval_every, "evaluations every --eval-every N iterations only; this run's N is 0",
             ("eval_episodes",)),
            ("curiosity", not config.curiosity.enabled, "--curiosity.coef > 0 only; this run's is 0", every),
            ("ppo", not config.policy.recurrent, feed_forward, ("sequence_length", "burn_in")),
            ("policy", not config.policy.recurrent, feed_forward, ("recurrent_cell", "recurrent_size"))):
        settings = getattr(config, section) if section else config
        given = type(settings)() if base is None else getattr(base, section) if section else base
        prefix = f"--{section.replace('_', '-')}." if section else "--"
        changed = [f"{prefix}{f.replace('_', '-')}" for f in fields or settings.__dataclass_fields__
                   if getattr(settings, f) != getattr(given, f)]
        if unused and changed:
            one = len(changed) == 1
            sentences.append(f"{', '.join(changed)} {'applies' if one else 'apply'} to {what} and does not use "
                             f"{'it' if one else 'them'}")
    return sentences


def note_capped(command: str, config: TrainConfig) -> None:
    """Says on stderr when a minibatch would exceed the batch, when a recurrent policy's ``--ppo.sequence-length``
    exceeds the fragments it is cut from, and when its ``--ppo.burn-in`` cannot act (sequences that are whole
    fragments have no earlier state)."""
    length, fragment, burn_in = config.ppo.sequence_length, config.rollout.fragment_length, config.ppo.burn_in
    if config.pretrain.dataset and not config.pretrain.steps:
        print(f"shoal {command}: --pretrain.steps 0: the dataset {config.pretrain.dataset} is loaded and checked "
              f"against the env's tree, and nothing is cloned from it (give --pretrain.steps to clone)",
              file=sys.stderr)
    if config.ppo.minibatch_size > config.steps_per_iteration and config.env != "external":
        print(f"shoal {command}: --ppo.minibatch-size {config.ppo.minibatch_size} is more than the "
              f"{config.steps_per_iteration} env steps of a batch (--train-batch-size, else --rollout.num-envs x "
              f"--rollout.fragment-length x --rollout.num-workers): each epoch is one step on the whole batch",
              file=sys.stderr)
    if config.policy.recurrent and length is not None and length > fragment:
        print(f"shoal {command}: --ppo.sequence-length {length} is longer than --rollout.fragment-length "
              f"{fragment}: sequences are whole fragments of {fragment} steps (a longer fragment makes longer "
              f"sequences)", file=sys.stderr)
    if config.policy.recurrent and burn_in and (length is None or length >= fragment):
        print(f"shoal {command}: --ppo.burn-in {burn_in} does nothing here: sequences are whole fragments (set "
              f"--ppo.sequence-length below --rollout.fragment-length {fragment}), so none has steps before it to "
              f"burn in from", file=sys.stderr)


def note_env_batch(command: str, config: TrainConfig, built: TrainConfig) -> TrainConfig:
    """Says on stderr when the trainer ``built`` from ``config`` steps another number of envs than
    ``--rollout.num-envs`` (a factory's env with a batch of its own: the builder takes its batch); returns the
    config the run goes on with (``built``'s)."""
    if built.rollout.num_envs != config.rollout.num_envs:
        print(f"shoal {command}: {env_batch_sentence(config, built.rollout.num_envs)}", file=sys.stderr)
    return built


def env_batch_sentence(config: TrainConfig, built: int) -> str:
    """What is said when ``config``'s env steps ``built`` envs, not ``--rollout.num-envs``."""
    return (f"--rollout.num-envs {config.rollout.num_envs} is not used: env {config.env} steps {built} envs together "
            f"itself (its own batch), and Shoal steps them as they are")


def note_policy_fit(command: str, config: TrainConfig, tree, learning: bool = True) -> None:
    """Says on stderr when the policy settings given (unlike their defaults) find nothing to act on in the env's
    observations: image encoder settings without an image leaf, normalisation without a float vector leaf; and
    when no policy learns (``learning`` False: every one fixed or random)."""
    if not learning:
        print(f"shoal {command}: no policy learns in this run (every one is fixed: --fixed-policies, random): it "
              f"plays and logs its episodes, and trains nothing", file=sys.stderr)
    from core.policies import PolicyConfig
    from core.policies.networks import image_layout, normalizes
    from core.specs import groups, iter_leaves

    specs = groups(tree).values()
    leaves = [leaf for g in specs for _, leaf in iter_leaves(g.agent.observation)]
    images = [leaf for leaf in leaves if image_layout(leaf) is not None]
    default, policy = PolicyConfig(), config.policy
    given = [f"--policy.{f.replace('_', '-')}" for f in ("image_encoder", "image_features", "leaf_encoders")
             if getattr(policy, f) != getattr(default, f)]
    if given and not images:
        print(f"shoal {command}: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to image "
              f"observations (3-D boxes with 1, 3 or 4 channels first or last and sides >= 8), and {config.env} has "
              f"none: every observation is flattened into the MLP", file=sys.stderr)
    if policy.critic != default.critic and sum(g.capacity for g in specs) == 1:
        print(f"shoal {command}: --policy.critic {policy.critic} reads every agent's observation, and {config.env} has "
              f"one agent: its critic sees what --policy.critic local would", file=sys.stderr)
    boxes = [leaf for g in specs for _, leaf in iter_leaves(g.agent.action) if leaf.kind == "box"]
    given = [f"--policy.{f.replace('_', '-')}" for f in ("squash_bounded_actions", "log_std_init")
             if getattr(policy, f) != getattr(default, f)]
    if given and not boxes:
        print(f"shoal {command}: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to box (continuous) "
              f"actions, and {config.env} has none: {'it does' if len(given) == 1 else 'they do'} nothing here",
              file=sys.stderr)
    cnn = policy.image_encoder != "flatten"  # (per-leaf overrides aside) images a CNN reads are not standardised
    if policy.normalize_observations and not any(normalizes(leaf, cnn and leaf in images) for leaf in leaves):
        print(f"shoal {command}: --policy.normalize-observations standardises float vector observations, and "
              f"{config.env} has none (images and discrete values are left as they are): it does nothing here",
              file=sys.stderr)


def note_schedule(command: str, config: TrainConfig, resume: bool) -> None:
    """Says on stderr when iterations run past the learning rate's annealing horizon (legal, rarely meant)."""
    if config.anneal_lr and config.iterations > config.schedule_iterations:
        print(f"shoal {command}: the learning rate anneals to 0 at iteration {config.schedule_iterations} "
              f"(--anneal-iterations{', kept from the run resumed' if resume else ''}), so iterations "
              f"{config.schedule_iterations + 1}..{config.iterations} will not learn: pass --anneal-iterations "
              f"{config.iterations} to stretch the schedule, or --no-anneal-lr", file=sys.stderr)


def check_resumed(command: str, saved: TrainConfig, config: TrainConfig) -> None:
    """What a resume's flags change of the run's ``saved`` config: a new ``--seed`` is refused (the checkpoint's
    random streams go on, so it would change nothing but the record); a new env or env keywords are said on stderr
    (the keywords given replace the saved ones as a whole)."""
    if config.seed != saved.seed:
        raise ValueError(f"--seed {config.seed} on a resume: the run goes on with the random streams its checkpoint "
                         f"holds (it started with --seed {saved.seed}), so a new seed would change nothing. Resume "
                         f"without --seed, or start a new run with --seed {config.seed} in a new --run-dir")
    if config.env != saved.env:
        print(f"shoal {command} --resume: the run was trained on env {saved.env!r} and goes on with --env "
              f"{config.env!r}", file=sys.stderr)
    if config.env_kwargs != saved.env_kwargs:
        def flag(kwargs) -> str:
            return " ".join(f"{k} {v}" for k, v in kwargs) or "(none)"
        print(f"shoal {command} --resume: the run was trained with --env-kwargs {flag(saved.env_kwargs)} and goes "
              f"on with --env-kwargs {flag(config.env_kwargs)} (the keywords given replace the saved ones: repeat "
              f"those to keep)", file=sys.stderr)


#: The share of the fragments produced that, dropped as stale, :func:`note_stale` tells about.
STALE_SHARE_TOLD = 0.25


def note_stale(command: str, config: TrainConfig, metrics: Mapping[str, float]) -> bool:
    """Says on stderr that a large share of what the fleet made was dropped as stale (``fragments_stale``, the
    worst learner's, over ``fragments_produced``: at least ``STALE_SHARE_TOLD`` of 8 or more), and how to keep
    it; True when it did (the run loop says it once)."""
    produced = metrics.get("fragments_produced", 0)
    stale = max((v for k, v in metrics.items() if k.rsplit("/", 1)[-1] == "fragments_stale"), default=0)
    if produced < 8 or stale < STALE_SHARE_TOLD * produced:
        return False
    if config.mode == "sync":
        why = ("simulators keep acting while the learner trains, and --mode sync trains only on steps acted by the "
               "current weights (docs/external-protocol.md): --mode async --max-staleness 1 trains on what they "
               "acted meanwhile" if config.env == "external" else "--mode sync trains only on data acted by the "
               "current weights: --mode async --max-staleness 1 trains on data one version old")
    else:
        fewer = ("fewer simulators (--external.instances) or a larger batch (--train-batch-size)"
                 if config.env == "external" else "fewer fragments per training (--rollout.num-workers, "
                 "--rollout.num-envs)")
        why = (f"they lagged the learner by more than --max-staleness {config.max_staleness} versions when it "
               f"trained: raise it, or make {fewer}")
    print(f"shoal {command}: {stale:.0f} of the {produced:.0f} fragments made so far were dropped as stale "
          f"(fragments_stale, never trained on); {why}", file=sys.stderr)
    return True


def note_past_selves(command: str, config: TrainConfig, tree) -> None:
    """Says on stderr when no policy of the run can take the past selves ``config`` asks for."""
    from orchestration.builder import assignment_for, past_self_players

    if config.past_selves.fraction and not past_self_players(config, tree, assignment_for(config, tree)):
        print(f"shoal {command}: --past-selves.* applies to a policy that plays every seat of a zero-sum group "
              f"alone (feed-forward, learning), and this run has none: no past self plays", file=sys.stderr)


__all__ = ["STALE_SHARE_TOLD", "UnusedSettingWarning", "check_resumed", "env_batch_sentence", "note_capped",
           "note_env_batch", "note_past_selves", "note_policy_fit", "note_schedule", "note_stale", "note_unused",
           "unused_settings"]
