"""Actor (seed 002): acts for every agent of a batched env with the policies mapped to it, records fragments.

One batched forward pass per group per step serves all envs and all agents of the group. Steps travel as
plain dicts of tensors and become a TensorDict once per fragment (:class:`core.buffers.FragmentBuilder`).
Behaviour log-probabilities are computed once per fragment where the policy allows it exactly
(``GroupPolicy.defers_log_prob``: discrete, multi-discrete and binary heads with few params): a step records
the action-head parameters, and :meth:`Actor.build_fragment` turns them into ``"log_prob"`` for all ``T`` steps
in one call, bit for bit the values a per-step computation gives. Evaluation actors (``record=False``) do not
compute those at all. Single-threaded; a fleet (:mod:`orchestration.fleet`, :mod:`orchestration.ray_fleet`)
drives it and delivers its fragments to the learners.

Usage loop::

    actor = Actor(env, policies, assign(env.tree), seed=0)
    fragment = actor.collect()                      # [env, fragment_length]
    learner.receive(fragment, actor.fragment_meta(fragment))
    actor.set_weights(pid, *learner.weights())      # newest weights, loaded at the fragment boundary
    state = actor.state(); actor.load_state_(state) # observations, recurrent state, episode bookkeeping
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from core.buffers import FragmentBuilder
from core.buffers.episodes import device_of
from core.layout import (ACTION, ACTION_MASK, ACTION_PARAMS, DONE, FRAGMENT_ID, LOG_PROB, MASK, NEXT, OBSERVATION,
                         RECURRENT_STATE, SHARED)
from core.policies import GroupPolicy
from core.specs import groups
from core.tensordicts import get_str, key_dict, make_td, nested_td
from orchestration.assignment import GroupAssignment
from orchestration.episode_records import episode_records
from orchestration.service_policy import fragment_versions


def _plain(td: TensorDictBase) -> dict:
    """A TensorDict as nested plain dicts (what FragmentBuilder stores per step: ~8 µs, no TensorDict built)."""
    items = key_dict(td).items()  # a plain one's own dict: ~3x faster
    return {k: _plain(v) if isinstance(v, TensorDictBase) else v for k, v in items}


class Actor:
    """Acts in ``env`` for all of its groups and records fragments of ``fragment_length`` steps.

    Args:
        env: a :class:`adapters.protocol.BatchedEnv`.
        policies: policy id -> module acting for the groups mapped to it (this actor's own copies).
        assignment: group -> :class:`orchestration.assignment.GroupAssignment` (:func:`assign` of the tree).
        fragment_length: steps per fragment.
        seed: seeds the env reset and the sampling generator.
        worker_id: goes into every fragment's metadata.
        deterministic: act with the policies' modes (evaluation actors): True for all policies, or the ids of
            those that should (a random opponent keeps sampling while the evaluated policy acts greedily).
        record: keep fragments (training actors); evaluation actors only count episodes.
    """

    def __init__(self, env, policies: Mapping[str, GroupPolicy], assignment: Mapping[str, GroupAssignment], *,
                 fragment_length: int = 128, seed: int = 0, worker_id: int = 0,
                 deterministic: bool | Collection[str] = False, record: bool = True) -> None:
        if missing := [g for g in groups(env.tree) if g not in assignment]:
            raise KeyError(f"no policy assigned to groups {missing}")
        self.env, self.policies, self.assignment = env, dict(policies), dict(assignment)
        self.fragment_length = fragment_length
        self.deterministic = set(self.policies) if deterministic is True else set(deterministic or ())
        self.record = record
        self.builder = FragmentBuilder(env.num_envs, worker_id=worker_id, fragment_length=fragment_length)
        self.versions = {pid: 0 for pid in self.policies}
        """Policy id -> version of the weights this actor acts with."""
        self.worker_id = worker_id
        self.env_steps = 0
        self._obs = env.reset(seed=seed)
        self.device = device_of(self._obs)
        """Where the env steps (``--env-kwargs device=cuda``): this actor acts there (policies, generator, flags)."""
        _move_policies_(self.policies, self.device, env)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._rnn: dict[tuple[str, str], torch.Tensor | None] = {}
        self._done = torch.ones(env.num_envs, 1, dtype=torch.bool, device=self.device)  # every env starts an episode

    def restart_episodes_(self, first_step: TensorDictBase) -> int:
        """Ends every open episode at the last fragment's end (not counted as finished: sums dropped, episode
        ids advance; recurrent states restart) and acts next on ``first_step`` (an env reset, e.g. another
        member of a collection). At a fragment boundary only; returns how many episodes were open."""
        if len(self.builder):
            raise RuntimeError("episodes can only be restarted at a fragment boundary")
        open_rows = ~self._done.reshape(-1)
        tracker = self.builder.tracker
        tracker.episode_count, tracker.carry = tracker.episode_count + open_rows.to(tracker.episode_count), None
        self._obs, self._rnn, self._done = first_step, {}, torch.ones_like(self._done)
        return int(open_rows.sum())

    # -- acting ------------------------------------------------------------------------------------------
    def act(self, obs: TensorDictBase, done: torch.Tensor | None,
            rnn: dict[tuple[str, str], torch.Tensor | None]) -> tuple[dict, TensorDict]:
        """The acting half of :meth:`step`: one batched forward per group over every row of ``obs``.

        The rows need not be this actor's envs (:class:`orchestration.polling_actor.PollingActor` passes the
        envs of whichever env processes are ready); the generator, policies and versions are this actor's.

        Args:
            obs: the step to act on, batch ``[B]`` (root keys of a protocol step; ``"next"`` is not read).
            done: ``[B, 1]`` bool, rows whose episode starts at this step (recurrent policies zero their state
                there); read by recurrent policies only, so None is fine without one.
            rnn: ``(group, policy id) -> [B, A, H]`` recurrent state (absent or None: zeros); updated in place
                with the next state. ``{}`` without a recurrent policy.

        Returns:
            ``(entries, actions)``: the step to record (plain nested dict of ``[B, ...]`` tensors, without
            ``"next"``) and the actions to send, batch ``[B]``.
        """
        root = key_dict(obs)
        shared = root.get(SHARED, None)
        entries, actions = {}, {}
        for group, assigned in self.assignment.items():
            g_obs = root[group]
            g = key_dict(g_obs)
            observation, mask, action_mask = g[OBSERVATION], g.get(MASK, None), g.get(ACTION_MASK, None)
            inputs = {OBSERVATION: observation, MASK: mask}  # a plain dict: the policy reads it ~10x faster
            if action_mask is not None:
                inputs[ACTION_MASK] = action_mask
            out = self._forward(group, assigned, inputs, shared, done, rnn)
            action = out[ACTION]
            # a policy may take agents out of training (orchestration.past_selves: seats a past self played)
            entry = {OBSERVATION: _maybe_plain(observation), MASK: out.get(MASK, mask), ACTION: action}
            if LOG_PROB in out:
                entry[LOG_PROB] = out[LOG_PROB]
            else:  # filled in for the whole fragment by build_fragment()
                entry[ACTION_PARAMS] = out[ACTION_PARAMS]
            if action_mask is not None:
                entry[ACTION_MASK] = action_mask
            if RECURRENT_STATE in out:
                entry[RECURRENT_STATE] = out[RECURRENT_STATE]
            entries[group] = entry
            batch = g_obs.batch_size
            if isinstance(action, dict):
                action = nested_td(action, batch)  # composite actions: nested dicts
            actions[group] = make_td({ACTION: action}, batch)
        if shared is not None:
            entries[SHARED] = _maybe_plain(shared)
        return entries, make_td(actions, obs.batch_size)

    def _forward(self, group: str, assigned: GroupAssignment, g_obs, shared, done, rnn) -> dict:
        """The policies' outputs for one group; a split group keeps each policy's outputs on its slots.

        Log-probabilities are computed per fragment (:meth:`build_fragment`) where the policy allows it, and not
        at all when nothing is recorded; a group split between policies merges per-step log-probabilities.
        """
        single = assigned.single
        # No critic here: the learner evaluates state values for the whole batch in one call.
        if single is not None and not self.policies[single].reads_episode_starts:  # the common case: nothing to carry
            return self.policies[single].act_step(g_obs, shared, self.generator, single in self.deterministic,
                                                  with_value=False, with_log_prob=False)
        outs = {}
        with_log_prob = self.record and single is None
        for pid in assigned.policies:
            policy = self.policies[pid]
            start = done.reshape(-1) if policy.reads_episode_starts else None  # recurrent policies, past selves
            out = policy.act_step(g_obs, shared, self.generator, pid in self.deterministic,
                                  rnn.get((group, pid)), start, with_value=False, with_log_prob=with_log_prob)
            if RECURRENT_STATE in out:
                rnn[(group, pid)] = out[NEXT][RECURRENT_STATE]
            outs[pid] = out
        if single is not None:
            return outs[single]
        merged = dict(outs[assigned.policies[0]])
        for pid in assigned.policies[1:]:
            slots = assigned.slots[pid]
            merged = {k: _where_slots(slots.to(self.device), outs[pid][k], v) for k, v in merged.items() if k != NEXT}
        return merged

    def step(self) -> TensorDictBase:
        """Acts once in every env; records the transition; returns the env's output (``"next"`` + next obs)."""
        entries, actions = self.act(self._obs, self._done, self._rnn)
        out = self.env.step(actions)
        nxt = get_str(out, NEXT)
        if self.record:
            entries[NEXT] = nxt if type(nxt) is TensorDict else _plain(nxt)  # the builder walks a plain one
            self.builder.add_step_(entries)
            if len(cut := getattr(self.env, "last_cut", ())):  # episodes a fault ended (adapters.protocol)
                self.builder.mark_cut_(cut)
        self._done = get_str(nxt, DONE)  # [E, 1]; reshaped only when a recurrent policy reads it (act)
        self._obs = out  # the next step to act on; "next" rides along unread (cheaper than exclude)
        self.env_steps += self.env.num_envs
        return out

    @torch.no_grad()
    def collect(self) -> TensorDict:
        """Runs ``fragment_length`` steps and returns the fragment ``[env, T]``."""
        for _ in range(self.fragment_length):
            self.step()
        return self.build_fragment()

    def sequences(self) -> dict[int, int]:
        """Worker id -> fragments built (one stream; a :class:`PollingActor` has one per env process)."""
        return {self.worker_id: self.builder.sequence}

    def fragment_meta(self, fragment: TensorDictBase) -> dict[str, Any]:
        """The delivery metadata of the fragment just built (:mod:`orchestration.inbox`): id, worker, sequence
        number, every acting policy's version, env steps and, in a collection, the member's ``env_id``."""
        meta = {"fragment_id": int(fragment.get(FRAGMENT_ID)[0, 0]), "worker_id": self.worker_id,
                "sequence": self.builder.sequence - 1, "policy_versions": dict(self.versions),
                "env_steps": fragment.batch_size.numel()}
        member = getattr(self.env, "member_id", None)  # a collection member (orchestration.collection_env)
        return meta if member is None else {**meta, "env_id": member}

    def build_fragment(self, builder: FragmentBuilder | None = None,
                       versions: Mapping[str, int] | None = None) -> TensorDict:
        """The steps recorded since the last fragment as a fragment ``[env, T]`` (``FragmentBuilder.build``).

        Groups whose policy recorded action-head parameters instead of log-probabilities get their
        ``"log_prob"`` here, computed for all ``T`` steps at once from the recorded params, actions and masks
        (the same values, bit for bit, as computing them step by step; ``Head.exact_log_prob``).

        Args:
            builder: whose steps to build (default: this actor's; a polling actor keeps one per env process).
            versions: policy id -> the version recorded as the fragment's (default: :func:`fragment_versions`).
        """
        builder = self.builder if builder is None else builder
        versions = fragment_versions(self.policies, self.versions) if versions is None else versions
        fragment = builder.build({g: versions[a.main_policy] for g, a in self.assignment.items()})
        for group, assigned in self.assignment.items():
            g = fragment.get(group)
            if ACTION_PARAMS in g.keys():  # only single-policy groups record params (_forward)
                params = g.get(ACTION_PARAMS)
                del g[ACTION_PARAMS]
                g.set(LOG_PROB, self.policies[assigned.main_policy].log_prob_from_params(
                    params, g.get(ACTION), g.get(ACTION_MASK, None)))
        return fragment

    @torch.no_grad()
    def run_episodes(self, num_episodes: int, max_steps: int = 100_000) -> dict[str, list[float]]:
        """Plays ``num_episodes`` episodes from their first step (evaluation): envs with an episode open (a
        previous evaluation's) are reset first, and each env counts its first ``num_episodes / E`` episodes (the
        first ``num_episodes % E`` envs one more), so that short episodes, which end first, are not favoured.

        Returns:
            ``"return"`` (all agents summed) and ``"return/<policy>"`` per counted episode, in order of ending.
        """
        if not bool(self._done.all()):
            self.restart_episodes_(self.env.reset())
        pids, num_envs = list(self.policies), self.env.num_envs
        quota = num_episodes // num_envs + (torch.arange(num_envs) < num_episodes % num_envs).long()  # [E]
        counted = torch.zeros(num_envs, dtype=torch.long)
        running = torch.zeros(len(pids), num_envs, dtype=torch.float64)
        finished: list[torch.Tensor] = []
        for _ in range(max_steps):
            if bool((counted >= quota).all()):
                break
            nxt = self.step().get(NEXT)
            for group, assigned in self.assignment.items():
                reward = torch.nan_to_num(nxt.get((group, "reward")).squeeze(-1).double()).cpu()  # [E, A]
                for pid, slots in assigned.slots.items():
                    running[pids.index(pid)] += (reward * slots).sum(-1)
            done = nxt.get(DONE).reshape(-1).cpu()
            if done.any():
                take = done & (counted < quota)
                take[torch.as_tensor(getattr(self.env, "last_cut", ()), dtype=torch.long)] = False  # a fault's end
                finished.append(running[:, take].clone())
                counted += take.long()
                running[:, done] = 0.0
        per_episode = torch.cat(finished, 1) if finished else torch.zeros(len(pids), 0)
        out = {f"return/{pid}": per_episode[i].tolist() for i, pid in enumerate(pids)}
        out["return"] = per_episode.sum(0).tolist()
        return out

    # -- data out, weights in ----------------------------------------------------------------------------
    def completed_episodes(self) -> dict[str, np.ndarray]:
        """Episodes that ended since the last call (:func:`episode_records` of the builder's records)."""
        return episode_records(self.builder.pop_completed_episodes(), self.assignment)

    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase, *, force: bool = False) -> bool:
        """Loads ``weights`` into this actor's copy of ``policy_id`` as ``version``.

        Skips the copy when the actor already acts with that version, unless ``force`` (a restored learner may
        republish a version number with other weights). Returns whether it copied.
        """
        if version == self.versions[policy_id] and not force:
            return False
        load = getattr(self.policies[policy_id], "load_weights_", None)  # central inference: to the service
        if load is not None:
            load(int(version), weights, force)
        else:
            with torch.no_grad():
                TensorDict.from_module(self.policies[policy_id]).update_(weights)
        self.versions[policy_id] = int(version)
        return True

    def policy_weights(self, policy_id: str) -> TensorDictBase:
        """A CPU copy of the weights this actor acts with for ``policy_id`` (central inference: the service's)."""
        policy = self.policies[policy_id]
        return policy.weights() if hasattr(policy, "load_weights_") else \
            TensorDict.from_module(policy).detach().clone().cpu()

    # -- state -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a resumed actor needs to continue exactly: ``{"tensors": {name: tensor}, "json": {...}}``.

        The sampling generator, the current observations, the recurrent states, the episode bookkeeping,
        the policy versions and the env's own state when it has one (``state_dict``); ``json["env_state"]``
        says whether it had (an env without it is reset on resume, so the continuation is not exact).
        """
        tensors: dict[str, torch.Tensor] = {"rng": self.generator.get_state(), "episode_start": self._done.reshape(-1),
                                            "episode_count": self.builder.tracker.episode_count}
        tensors.update(_flat("obs", self._obs))
        meta: dict[str, Any] = {"obs": _layout(self._obs), "sequence": self.builder.sequence,
                                "versions": dict(self.versions), "env_steps": self.env_steps, "carry": None,
                                "rnn": [], "env_state": hasattr(self.env, "state_dict")}
        carry = self.builder.tracker.carry
        if carry is not None:
            tensors.update(_flat("carry", carry))
            meta["carry"] = _layout(carry)
        for (group, pid), h in self._rnn.items():
            if h is not None:
                tensors[f"rnn/{group}/{pid}"] = h
                meta["rnn"].append([group, pid])
        if meta["env_state"]:
            tensors.update({f"env/{k}": v for k, v in self.env.state_dict().items()})
        meta["policies"] = {pid: p.state()["json"] for pid, p in self.policies.items() if hasattr(p, "state")}
        tensors.update({f"policy/{pid}/{k}": v for pid, p in self.policies.items() if hasattr(p, "state")
                        for k, v in p.state()["tensors"].items()})
        return {"tensors": {k: v.cpu() for k, v in tensors.items()}, "json": meta}  # checkpoints hold CPU tensors

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Loads a :meth:`state` taken from an actor of the same config (weights are loaded separately).

        The env's state and the current observations are restored only when both the saved and this env
        can save their state; otherwise this actor keeps its freshly reset envs (a new episode everywhere).
        """
        tensors, meta = state["tensors"], state["json"]
        # generator states stay CPU byte tensors on every device; an env (and a policy's pool) moves its own
        tensors = {k: v if k.startswith(("rng", "env/", "policy/")) else v.to(self.device) for k, v in tensors.items()}
        if (saved := tensors["episode_count"].shape[0]) != self.builder.tracker.num_envs:  # caught before a fragment
            raise ValueError(f"size mismatch for the actor's envs: the checkpoint holds {saved}, this actor "
                             f"{self.builder.tracker.num_envs}")
        self.versions.update({k: int(v) for k, v in meta["versions"].items()})
        self.generator.set_state(tensors["rng"])
        self.env_steps = int(meta["env_steps"])
        self.builder.sequence = int(meta["sequence"])
        self.builder.tracker.episode_count = tensors["episode_count"].clone()
        if meta["carry"] is not None:
            self.builder.tracker.carry = _unflat("carry", tensors, meta["carry"])
        self._rnn = {(g, p): tensors[f"rnn/{g}/{p}"] for g, p in meta.get("rnn", [])}
        for pid, saved in meta.get("policies", {}).items():  # e.g. a pool of past selves
            head = f"policy/{pid}/"
            self.policies[pid].load_state_({"json": saved, "tensors": {k[len(head):]: v for k, v in tensors.items()
                                                                       if k.startswith(head)}})
        if meta["env_state"] and hasattr(self.env, "load_state_dict"):
            self.env.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("env/")})
            self._obs = _unflat("obs", tensors, meta["obs"])
            self._done = tensors["episode_start"].clone().reshape(-1, 1)  # [E]: envs starting an episode


def _move_policies_(policies: Mapping[str, Any], device: torch.device, env) -> None:
    """Moves this actor's policy copies to its env's ``device``; stand-ins (past selves, central inference) refused."""
    for pid, policy in policies.items() if device.type != "cpu" else ():
        if not isinstance(policy, torch.nn.Module):
            raise ValueError(f"policy {pid!r} acts through {type(policy).__name__}, which takes CPU steps, but the env "
                             f"{type(env).__name__} steps on {device}: pass --env-kwargs device=cpu (or leave out "
                             f"past selves and --rollout.central-inference)")
        policy.to(device)


def _flat(prefix: str, td: TensorDictBase) -> dict[str, torch.Tensor]:
    return {f"{prefix}/{'/'.join(k) if isinstance(k, tuple) else k}": v
            for k, v in td.items(include_nested=True, leaves_only=True)}


def _layout(td: TensorDictBase) -> dict:
    nodes = {"/".join(k) if isinstance(k, tuple) else k: list(v.batch_size)
             for k, v in td.items(include_nested=True) if isinstance(v, TensorDictBase)}
    return {"batch": list(td.batch_size), "groups": nodes}


def _unflat(prefix: str, tensors: Mapping[str, torch.Tensor], layout: Mapping[str, Any]) -> TensorDict:
    td = TensorDict(batch_size=layout["batch"])
    for key in sorted(layout["groups"], key=lambda k: k.count("/")):  # parents first
        td.set(tuple(key.split("/")), TensorDict(batch_size=layout["groups"][key]))
    head = f"{prefix}/"
    for key, value in tensors.items():
        if key.startswith(head):
            td.set(tuple(key[len(head):].split("/")), value)
    return td


def _where_slots(slots: torch.Tensor, new, old):
    """``new`` on the agent slots marked in ``slots`` (``[A]``), ``old`` elsewhere; recurses into dicts."""
    if isinstance(new, dict):
        return {k: _where_slots(slots, new[k], old[k]) for k in new}
    return torch.where(slots.reshape(1, -1, *([1] * (new.dim() - 2))), new, old)


def _maybe_plain(value):
    return _plain(value) if isinstance(value, TensorDictBase) else value


__all__ = ["Actor", "episode_records"]
