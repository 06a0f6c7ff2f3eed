"""The one builder: policies, learners, actors, fleets and trainers from a :class:`TrainConfig`.

Every entry point builds through here: local and Ray training, Ray rollout workers and learner actors,
``shoal evaluate``, ``shoal export``, resume and the league. So a policy, a learner or the agent -> policy
assignment is spelled once, and both backends start from the same weights.

Usage::

    trainer = build_trainer(config)          # config.backend picks the fleet and the learners
    while trainer.iteration < config.iterations:
        metrics = trainer.train()
    trainer.close()
"""

from __future__ import annotations

import copy
import difflib
import warnings
from functools import partial
from typing import Any, Collection, Mapping

import torch

from core.policies import GroupPolicy, make_policies
from core.specs import Tree, groups
from orchestration.allocator import keep_freed_memory
from orchestration.actor import Actor
from orchestration.assignment import GroupAssignment, assign, groups_of
from orchestration.config import TrainConfig
from orchestration.collection_env import make_actor_env
from orchestration.env_collection import load_collection, probe_members, with_collection
from orchestration.envs import imports_code, make_run_env
from orchestration.devices import resolve_device
from orchestration.learner import FixedLearner, PPOLearner
from orchestration.run_notes import UnusedSettingWarning, env_batch_sentence, unused_settings
from orchestration.team_critic import TEAM_CRITIC, build_team_critic, teams_for


def fixed_policy_ids(config: TrainConfig) -> set[str]:
    """Policy ids that do not learn: ``random`` and ``config.fixed_policies``."""
    return {"random", *config.fixed_policies}


def is_fixed(config: TrainConfig, policy_id: str) -> bool:
    """Whether ``policy_id`` (possibly ``"<id>@<group>"``, see :func:`assignment_for`) does not learn."""
    return policy_id.split("@", 1)[0] in fixed_policy_ids(config)


def assignment_for(config: TrainConfig, tree: Tree) -> dict[str, GroupAssignment]:
    """Group -> policies acting in it: the tree's default mapping with ``config.policy_mapping`` applied; a
    fixed policy acting in groups with different spaces gets one module per group (``"<id>@<group>"``).

    Raises:
        ValueError: a mapped policy id that reads as a scripted player or a path (they play in evaluation only)
            or as a misspelt ``random``, or a ``fixed_policies`` id that no agent is mapped to.
    """
    for agent, pid in config.policy_mapping:
        if ":" in pid or "/" in pid or "\\" in pid:
            raise ValueError(f"--policy-mapping {agent} {pid}: a policy id names a policy of this run (a new learning "
                             f"one, or a frozen one with --fixed-policies) or 'random'; a scripted player or a "
                             f"checkpoint plays only in evaluation: shoal evaluate CKPT --opponent {pid}")
        if pid != "random" and difflib.get_close_matches(pid.lower(), ["random"], n=1, cutoff=0.8):
            raise ValueError(f"--policy-mapping {agent} {pid}: did you mean 'random' (the uniform policy)? A policy "
                             f"id this close to it is refused as a likely typo; name a new policy otherwise")
    assignment = assign(tree, dict(config.policy_mapping), per_group=fixed_policy_ids(config))
    acting = sorted({pid.split("@", 1)[0] for a in assignment.values() for pid in a.policies})
    for pid in config.fixed_policies:
        if pid not in acting:
            near = difflib.get_close_matches(pid, acting, n=1)
            raise ValueError(f"--fixed-policies {pid}: no agent plays policy {pid!r}; the run's policies are "
                             f"{acting}{f' (did you mean {near[0]!r}?)' if near else ''}")
    return assignment


def policy_module(config: TrainConfig, tree: Tree, assignment: Mapping[str, GroupAssignment],
                  policy_id: str, built: Mapping[str, GroupPolicy] | None = None) -> GroupPolicy:
    """A module with the architecture of ``policy_id``: its group's, or a fresh copy of the first group's it
    acts in (a policy id that is not a group name). Initial values are drawn from the global generator.

    Raises:
        ValueError: a learning policy acting in groups whose spaces differ (parameters cannot be shared).
    """
    policies = built if built is not None else make_policies(tree, config.policy)
    acting = [g for g, a in assignment.items() if policy_id in a.policies]
    specs = groups(tree)
    if len({specs[g].agent for g in acting}) > 1:
        raise ValueError(f"policy {policy_id!r} acts for groups {acting}, whose observation or action spaces "
                         f"differ: one network cannot serve them; map their agents to different policy ids")
    if policy_id in policies:
        return policies[policy_id]
    policy = copy.deepcopy(policies[acting[0]])
    for module in policy.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return policy


def build_policies(config: TrainConfig, tree: Tree,
                   assignment: Mapping[str, GroupAssignment]) -> tuple[dict[str, GroupPolicy], set[str]]:
    """Policy id -> initial module, and the ids that do not learn; the same draws on every backend: made from a
    generator seeded with ``config.seed`` (torch's global one, forked: the caller's stream is untouched), so that
    envs built before (torchrl envs draw from it, as many as the backend builds) never move the initial weights.
    ``random`` gets a uniform policy."""
    out, fixed = {}, set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        made = make_policies(tree, config.policy)
        for pid in sorted({p for a in assignment.values() for p in a.policies}):
            policy = policy_module(config, tree, assignment, pid, made)  # other policy ids draw their values
            if is_fixed(config, pid):
                fixed.add(pid)
                if pid.split("@", 1)[0] == "random":
                    policy = _uniform(policy)
            out[pid] = policy
    return out, fixed


def _uniform(policy: GroupPolicy) -> GroupPolicy:
    """The random policy: zero action-parameter layer, so every legal action is equally likely."""
    policy = copy.deepcopy(policy)
    with torch.no_grad():
        policy.actor_out.weight.zero_()
        policy.actor_out.bias.zero_()
    return policy


def build_learner(config: TrainConfig, assignment: Mapping[str, GroupAssignment], policy_id: str,
                  policy: GroupPolicy, *, device: str | torch.device | None = None,
                  batch_steps: int | None = None) -> PPOLearner:
    """The PPO learner of ``policy_id`` (trains ``policy`` itself: pass a copy to keep the original)."""
    return PPOLearner(policy, groups_of(assignment, policy_id), policy_id=policy_id, ppo=config.ppo, lr=config.lr,
                      batch_steps=batch_steps or config.steps_per_iteration, seed=config.seed,
                      device=device if device is not None else resolve_device(config.device),
                      max_staleness=_max_staleness(config),
                      reuse_limit=config.reuse_limit if config.mode == "async" else 1,
                      max_skipped_updates=config.max_skipped_updates, curiosity=config.curiosity)


def _max_staleness(config: TrainConfig) -> int | None:
    """Synchronous mode trains on each fragment once, with the weights that made it: its actors wait while the
    learners train, so nothing lags (None: no rule needed). External simulators cannot be made to wait: what
    they did with older weights while the learners trained is stale (0), dropped and counted."""
    if config.mode == "async":
        return config.max_staleness
    return 0 if config.env == "external" else None


def build_learners(config: TrainConfig, assignment: Mapping[str, GroupAssignment],
                   policies: Mapping[str, GroupPolicy], fixed: Collection[str]) -> dict[str, Any]:
    """Policy id -> :class:`PPOLearner` or :class:`FixedLearner` (local objects)."""
    return {pid: FixedLearner(policy) if pid in fixed else build_learner(config, assignment, pid, policy)
            for pid, policy in policies.items()}


def worker_id_of(slot: int, incarnation: int) -> int:
    """``(incarnation << 16) | slot``: incarnation 0 of slot ``i`` is worker ``i`` on every backend."""
    if not (0 <= slot < 2**16 and 0 <= incarnation < 2**15):
        raise ValueError(f"slot {slot} or incarnation {incarnation} out of range")
    return (incarnation << 16) | slot


def worker_seed(seed: int, slot: int, incarnation: int) -> int:
    """Seed of a worker's env and sampling generator; a re-created worker gets a fresh stream."""
    return seed + 1000 * slot + 10**7 * incarnation


def stream_worker_ids(config: TrainConfig, slot: int, incarnation: int) -> list[int]:
    """Worker ids of the fragment streams of rollout worker ``slot``: its own id, and with ``env_polling`` one
    per env process (process ``k`` of slot ``i`` is slot ``i + k * num_workers``: distinct across the fleet)."""
    rc = config.rollout
    streams = rc.env_processes if rc.env_polling else 1
    return [worker_id_of(slot + k * rc.num_workers, incarnation) for k in range(streams)]


def build_actor(config: TrainConfig, env, policies: Mapping[str, GroupPolicy],
                assignment: Mapping[str, GroupAssignment], *, slot: int = 0, incarnation: int = 0) -> Actor:
    """The training actor of rollout worker ``slot`` (its ``incarnation``-th re-creation) on ``env``: an
    :class:`Actor`, or with ``rollout.env_polling`` a :class:`orchestration.polling_actor.PollingActor` that acts
    for whichever env processes are ready."""
    if config.rollout.env_polling:
        from orchestration.polling_actor import PollingActor

        return PollingActor(env, policies, assignment, fragment_length=config.rollout.fragment_length,
                            seed=worker_seed(config.seed, slot, incarnation),
                            worker_id=worker_id_of(slot, incarnation),
                            worker_ids=stream_worker_ids(config, slot, incarnation))
    seed = worker_seed(config.seed, slot, incarnation)
    return Actor(env, with_past_selves(config, env.tree, policies, assignment, seed), assignment,
                 fragment_length=config.rollout.fragment_length, seed=seed, worker_id=worker_id_of(slot, incarnation))


def with_past_selves(config: TrainConfig, tree: Tree, policies: Mapping[str, Any],
                     assignment: Mapping[str, GroupAssignment], seed: int) -> dict[str, Any]:
    """``policies`` with :class:`orchestration.past_selves.PastSelves` stand-ins for the learning, feed-forward
    policies that play every seat (>= 2) of one zero-sum group and no other group (``config.past_selves``)."""
    if config.past_selves.fraction == 0.0:
        return dict(policies)
    from orchestration.past_selves import PastSelves

    out = dict(policies)
    for pid in past_self_players(config, tree, assignment, policies):
        out[pid] = PastSelves(policies[pid], config.past_selves, seed=seed + 7)
    return out


def check_polling(config: TrainConfig, tree: Tree, assignment: Mapping[str, GroupAssignment],
                  policies: Mapping[str, Any]) -> None:
    """Refuses ``rollout.env_polling`` where past selves would play (a polling actor acts for a changing set of
    env rows at each step, and past selves draw their seats per env row at episode starts): they are not
    dropped in silence."""
    if not config.rollout.env_polling or config.past_selves.fraction == 0.0:
        return
    players = past_self_players(config, tree, assignment, policies)
    if players:
        raise ValueError(f"--rollout.env-polling: a polling actor does not seat past selves, which play for "
                         f"{', '.join(map(repr, players))} here (--past-selves.fraction "
                         f"{config.past_selves.fraction:g}, on by default in zero-sum self-play); set "
                         f"--past-selves.fraction 0 to self-play without them, or drop --rollout.env-polling")


def past_self_players(config: TrainConfig, tree: Tree, assignment: Mapping[str, GroupAssignment],
                      policies: Mapping[str, Any] | None = None) -> list[str]:
    """The policies past selves can stand in for (:func:`with_past_selves`), whatever ``config.past_selves``:
    learning, feed-forward (``policies``' modules, else ``config.policy``) and alone on every seat of a zero-sum
    group."""
    specs, out = groups(tree), []
    for group, assigned in assignment.items():
        pid = assigned.single
        if pid is None or is_fixed(config, pid) or specs[group].payoff != "zero_sum" or specs[group].capacity < 2:
            continue
        feed_forward = not config.policy.recurrent if policies is None else (
            isinstance(policies[pid], GroupPolicy) and not policies[pid].recurrent)
        if feed_forward and sum(pid in a.policies for a in assignment.values()) == 1:
            out.append(pid)
    return out


def build_evaluator(config: TrainConfig, policies: Mapping[str, GroupPolicy], assignment: Mapping[str, GroupAssignment],
                    fixed: Collection[str], num_envs: int | None = None, *, trusted_collection: bool = False) -> Actor:
    """A deterministic actor on its own envs: learned policies act with their modes, fixed ones keep sampling.
    With a collection, on its evaluation envs (the first until switched; ``trusted_collection``: the config's
    collection was resolved by this run, see :func:`orchestration.env_collection.load_collection`)."""
    env = make_actor_env(config, num_envs or min(config.rollout.num_envs, config.eval_episodes), evaluation=True,
                         trusted=trusted_collection)
    copies = {pid: copy.deepcopy(p).cpu() for pid, p in policies.items()}
    return Actor(env, copies, assignment, seed=config.seed + 10**6, record=False,
                 deterministic=[p for p in policies if p not in fixed])


def pretrain_policies_(config: TrainConfig, tree: Tree, assignment: Mapping[str, GroupAssignment],
                       policies: Mapping[str, GroupPolicy],
                       fixed: Collection[str]) -> dict[str, list[dict[str, float]]]:
    """Behaviour-clones ``config.pretrain.dataset`` into every learning policy in place (each on the recorded
    agents of its groups), before learners and actors copy the modules; returns each policy's reports (none
    without a dataset).

    Raises:
        DatasetError: a dataset that does not load, or was recorded in another tree than ``tree``.
    """
    pc = config.pretrain
    if not pc.dataset:
        return {}
    from core.losses.bc import BCConfig
    from orchestration.dataset_learner import pretrain_
    from orchestration.datasets import check_tree, load_dataset

    dataset = load_dataset(pc.dataset)
    check_tree(dataset, tree, path=pc.dataset, env=config.env)
    bc = BCConfig(lr=pc.lr, minibatch_size=pc.minibatch_size)
    return {pid: pretrain_(policies[pid], dataset, bc, steps=pc.steps, groups=groups_of(assignment, pid),
                           seed=config.seed, device=resolve_device(config.device), policy_id=pid)
            for pid in sorted(set(policies) - set(fixed))}


def _with_env_batch(config: TrainConfig, built: int | None) -> TrainConfig:
    """``config`` with ``rollout.num_envs`` set to the ``built`` envs a factory's env brings itself (a batched
    torchrl env: its batch is the env dim), said in an :class:`UnusedSettingWarning` when it is not the number
    asked for; batch sizes and env-step counts then follow what is stepped. ``config`` itself otherwise."""
    import dataclasses

    if built is None or built == config.rollout.num_envs:
        return config
    warnings.warn(env_batch_sentence(config, built), UnusedSettingWarning, stacklevel=3)
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, num_envs=built))


def build_trainer(config: TrainConfig, *, pretrain: bool = True):
    """The composition root: a :class:`orchestration.trainer.Trainer` over the backend ``config`` names.

    ``local``: actors in this process (:class:`LocalFleet`) and local learners; ``ray``: rollout workers and
    learner actors (:func:`orchestration.ray_session.build_ray_parts`). Both start from the same weights:
    with ``config.pretrain.dataset`` (and ``pretrain``; False for a resumed run, whose checkpoint holds trained
    weights) the learning policies are behaviour-cloned first (:func:`pretrain_policies_`). Settings given that
    the run does not use (the Ray backend's on a local run, ...) are each named in an
    :class:`orchestration.run_notes.UnusedSettingWarning`, never ignored in silence.
    """
    from orchestration.fleet import LocalFleet
    from orchestration.trainer import Trainer

    for sentence in unused_settings(config):
        warnings.warn(sentence, UnusedSettingWarning, stacklevel=2)

    keep_freed_memory()  # this process trains: its activations' pages stay mapped (orchestration.allocator)
    torch.manual_seed(config.seed)  # what draws from the global generator before build_policies (torchrl envs)
    collection = load_collection(config)  # a file is read once: the run (and its checkpoints) keep the document
    config = with_collection(config, collection)
    rc = config.rollout
    if config.env == "external":  # simulators connect over the network: the tree comes from the first of them
        if pretrain and config.pretrain.dataset:
            raise ValueError("--pretrain.dataset: external simulators bring their tree when they connect; "
                             "pretraining needs it before the learners are built (clone with "
                             "orchestration.dataset_learner.BCLearner and start from its weights instead)")
        if config.policy.recurrent:  # the server keeps no recurrent state per episode (docs/external-protocol.md)
            raise ValueError("--policy.recurrent: external environments are served by feed-forward policies only; "
                             "the server keeps no recurrent state per episode (drop --policy.recurrent)")
        teams_for(config, None, {}, ())  # --team-critic.enabled is refused here, naming why
        from orchestration.external_fleet import build_external

        fleet, learners, tree, close = build_external(config)  # local or Ray learners, as config.backend says
        return Trainer(config, fleet, learners, None, tree, on_close=close)
    if collection is not None:  # every member built once: one tree, priors the envs can draw
        tree = probe_members(config, collection)
    if config.backend == "ray":
        if collection is None:
            # a user's module:factory may bring an env batch of its own, whatever it is asked for: build the
            # number asked, so that it shows (a probe of 1 cannot tell a batch of 1 from one env as asked)
            own = ":" in config.env and imports_code(config.env) is not None
            probe = make_run_env(config, rc.num_envs if own else 1)
            tree, config = probe.tree, _with_env_batch(config, probe.num_envs if own else None)
            probe.close()
        assignment = assignment_for(config, tree)
        policies, fixed = build_policies(config, tree, assignment)
        teams = teams_for(config, tree, assignment, set(policies) - fixed)  # refuses what it cannot do, first
        check_polling(config, tree, assignment, policies)
        if pretrain:
            pretrain_policies_(config, tree, assignment, policies, fixed)
        from orchestration.ray_session import build_ray_parts

        fleet, learners, critic, close = build_ray_parts(config, tree, policies, fixed, teams)
        learners.update({pid: FixedLearner(policies[pid]) for pid in fixed})
    else:
        envs = [make_actor_env(config, rc.num_envs) for _ in range(rc.num_workers)]
        tree, config = envs[0].tree, _with_env_batch(config, envs[0].num_envs)
        assignment = assignment_for(config, tree)
        policies, fixed = build_policies(config, tree, assignment)
        try:
            teams = teams_for(config, tree, assignment, set(policies) - fixed)
            check_polling(config, tree, assignment, policies)
            if pretrain:
                pretrain_policies_(config, tree, assignment, policies, fixed)
        except BaseException:
            for env in envs:
                env.close()
            raise
        learners = build_learners(config, assignment, policies, fixed)
        shared, close = None, None
        if rc.central_inference:  # one service answers every actor in batched forwards
            from orchestration.inference import InferenceConfig, InferenceService
            from orchestration.service_policy import ServicePolicy

            service = InferenceService({pid: learners[pid].actor_policy() for pid in policies},
                                       InferenceConfig(device=config.device, seed=config.seed)).start()
            shared, close = {pid: ServicePolicy(pid, service, policies[pid]) for pid in policies}, service.close
        actors = [build_actor(config, env, shared or {pid: learners[pid].actor_policy() for pid in policies},
                              assignment, slot=i) for i, env in enumerate(envs)]
        critic = build_team_critic(config, tree, teams)  # one more receiver of every fragment
        receivers = {pid: lrn for pid, lrn in learners.items() if lrn.learns}
        fleet = LocalFleet(config, actors, receivers if critic is None else {**receivers, TEAM_CRITIC: critic})
    make_evaluator = partial(build_evaluator, config, policies, assignment, fixed, trusted_collection=True)
    return Trainer(config, fleet, learners, make_evaluator() if config.eval_every else None, tree, on_close=close,
                   team_critic=critic, make_evaluator=make_evaluator)


__all__ = ["assignment_for", "build_actor", "build_evaluator", "build_learner", "build_learners", "build_policies",
           "build_trainer", "check_polling", "fixed_policy_ids", "is_fixed", "policy_module", "pretrain_policies_",
           "stream_worker_ids", "worker_id_of", "worker_seed"]
