"""Running an environment collection (seed 002): a batched env that runs one member at a time, the switch at a
fragment boundary, and the per-env keys fragments add to the episode statistics.

An actor runs ONE member over all of its env rows (:class:`CollectionEnv`); the trainer's driver
(:mod:`orchestration.collection_driver`) gives each actor its member before an iteration, and the actor
switches at its next fragment boundary (:func:`switch_member_`): the open episodes end where the last
fragment ended, which learners already treat as a truncation (they bootstrap there), they are left out of
the episode statistics and counted in ``collection/switch_truncations``, and every row of the new member
starts afresh. Fragments record the member in their metadata (``env_id``) and their episodes under
``env:<id>/...`` (:func:`tag_fragment`), so per-env metrics come out the same on every backend.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
from tensordict import TensorDict

from core.envsets import EnvCollection, PriorDistribution
from orchestration.env_collection import (ENV_KEY, check_params_supported, check_same_tree, load_collection,
                                          member_config)
from orchestration.envs import make_run_env

_SEED_STRIDE = 7919  # member k's envs are first reset with seed + stride * (k + 1)
_PRIOR_STREAM = 104_729  # the prior's generator: seed + this


class CollectionEnv:
    """A batched env that runs one member of a collection at a time over all of its rows.

    Members are built on first use (``build(env_id)`` -> a batched env) and kept; each is first reset with a
    seed of its own, later switches continue its streams. Protocol methods act on the current member.

    Args:
        collection: the collection.
        build: env id -> that member's batched env (every member the same ``num_envs``).
        env_id: the member to start on.
        report: keep the prior's draws for :meth:`pop_report_` (training actors; evaluators never pop them).
    """

    def __init__(self, collection: EnvCollection, build: Callable[[str], Any], env_id: str, *,
                 report: bool = True) -> None:
        self.collection, self._build, self._report = collection, build, report
        self._envs: dict[str, Any] = {}
        self._was_reset: set[str] = set()
        self._prior = collection.structure if isinstance(collection.structure, PriorDistribution) else None
        self._generator = torch.Generator().manual_seed(_PRIOR_STREAM)
        self._seed = 0
        self._cut = 0
        self._drawn: dict[str, list[torch.Tensor]] = {}
        self._first = env_id
        self._env = self._member(env_id)
        self.member_id = env_id
        """The env id of the member running now."""
        self.tree = self._env.tree

    def _member(self, env_id: str):
        env = self._envs.get(env_id)
        if env is None:
            env = self._build(env_id)
            if self._envs:
                check_same_tree(self.collection, self._first, self.tree, env_id, env.tree)
            check_params_supported(self.collection, env_id, env)
            if self._prior is not None:
                env.set_param_sampler(self._sample)
            self._envs[env_id] = env
        return env

    def _sample(self, n: int) -> dict[str, torch.Tensor]:
        params = self.collection.sample_params(n, self._generator)
        for name, values in params.items() if self._report else ():
            self._drawn.setdefault(name, []).append(values)
        return params

    @property
    def num_envs(self) -> int:
        return self._env.num_envs

    @property
    def counters(self) -> dict[str, int]:
        """Every member's counters, summed."""
        out: dict[str, int] = {}
        for env in self._envs.values():
            for name, value in getattr(env, "counters", {}).items():
                out[name] = out.get(name, 0) + value
        return out

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets the current member (``seed`` also seeds the other members' first resets and the prior)."""
        if seed is not None:
            self._seed = seed
            self._generator.manual_seed(seed + _PRIOR_STREAM)
        self._was_reset.add(self.member_id)
        return self._env.reset(seed=seed)

    def step(self, actions: TensorDict) -> TensorDict:
        return self._env.step(actions)

    @property
    def last_cut(self):
        """The current member's envs whose episode its last step cut (:mod:`adapters.protocol`)."""
        return getattr(self._env, "last_cut", ())

    def switch_(self, env_id: str) -> TensorDict:
        """Runs ``env_id`` from now on (building it on first use) and resets all of its rows; returns the first
        step to act on. Call at a fragment boundary only (:func:`switch_member_` does)."""
        env = self._member(env_id)
        first = env_id not in self._was_reset
        self._was_reset.add(env_id)
        self.member_id, self._env = env_id, env
        k = self.collection.ids.index(env_id)
        return env.reset(seed=self._seed + _SEED_STRIDE * (k + 1) if first else None)

    def note_cut_(self, episodes: int) -> None:
        """Counts open episodes a switch ended (reported with the next fragment)."""
        self._cut += episodes

    def pop_report_(self) -> dict[str, Any]:
        """What happened since the last call: ``switch_truncations`` and the prior's draws ``{name: [k]}``."""
        report = {"switch_truncations": self._cut,
                  "params": {name: torch.cat(parts) for name, parts in self._drawn.items()}}
        self._cut, self._drawn = 0, {}
        return report

    # -- state: only where every member built so far saves its own --------------------------------------
    def __getattr__(self, name: str):
        if name in ("state_dict", "load_state_dict") and all(
                hasattr(env, "state_dict") for env in self.__dict__.get("_envs", {}).values()):
            return getattr(self, f"_{name}")
        raise AttributeError(name)

    def _state_dict(self) -> dict[str, torch.Tensor]:
        ids = self.collection.ids
        out = {"current": torch.tensor(ids.index(self.member_id)), "seed": torch.tensor(self._seed),
               "reset": torch.tensor([i in self._was_reset for i in ids]), "prior_rng": self._generator.get_state()}
        for env_id, env in self._envs.items():
            out.update({f"member/{ids.index(env_id)}/{k}": v for k, v in env.state_dict().items()})
        return out

    def _load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ids = self.collection.ids
        self._seed = int(state["seed"])
        self._generator.set_state(state["prior_rng"])
        self._was_reset = {env_id for env_id, was in zip(ids, state["reset"].tolist()) if was}
        for k, env_id in enumerate(ids):
            head = f"member/{k}/"
            own = {key[len(head):]: v for key, v in state.items() if key.startswith(head)}
            if own:
                self._member(env_id).load_state_dict(own)
        self.member_id = ids[int(state["current"])]
        self._env = self._member(self.member_id)
        self._cut, self._drawn = 0, {}  # draws of the reset this env had before: superseded by the saved state

    def close(self) -> None:
        """Closes every member built."""
        for env in self._envs.values():
            env.close()


def make_actor_env(config, num_envs: int, *, evaluation: bool = False, trusted: bool = True):
    """``num_envs`` envs of ``config``: :func:`make_run_env`, or with a collection a :class:`CollectionEnv` that
    starts on the first training env id (``evaluation``: the first evaluation id). ``trusted``: see
    :func:`orchestration.env_collection.load_collection` (configs this run resolved are)."""
    collection = load_collection(config, trusted=trusted)
    if collection is None:
        return make_run_env(config, num_envs)
    ids = collection.evaluation_ids() if evaluation else collection.training_ids(collection.initial_state())
    return CollectionEnv(collection, lambda env_id: make_run_env(member_config(config, collection, env_id),
                                                                 num_envs), ids[0], report=not evaluation)


def switch_member_(actor, env_id: str, *, force: bool = False) -> int:
    """Has ``actor`` (on a :class:`CollectionEnv`, at a fragment boundary) act in member ``env_id`` from now on.

    Every row starts a new episode there: the open episodes end at the last fragment's end, which was
    already cut with truncation semantics (the learner bootstraps there); they are not counted as finished
    episodes (their running sums are dropped and their episode ids advance). Recurrent states restart.
    Nothing happens when ``env_id`` runs already, unless ``force`` (a fresh start, e.g. for evaluation).

    Returns:
        The number of open episodes ended (counted in ``collection/switch_truncations``).
    """
    if not hasattr(actor.env, "switch_"):  # (a worker's TimedEnv forwards a collection's methods)
        raise ValueError(f"cannot switch to collection member {env_id!r}: this actor's env "
                         f"({type(actor.env).__name__}) is not a collection (a run of one is built with "
                         f"--collection FILE)")
    if env_id == actor.env.member_id and not force:
        return 0
    if len(actor.builder):
        raise RuntimeError("a collection member can only be switched at a fragment boundary")
    cut = actor.restart_episodes_(actor.env.switch_(env_id))
    if actor.record:
        actor.env.note_cut_(cut)
    return cut


def tag_fragment(episodes: Mapping[str, Any], env) -> dict[str, Any]:
    """The completed-episode arrays of one fragment plus per-env entries (``env:<id>/return``, ``/length``,
    ``/fragments``, ``/switch_truncations``, ``/param/<name>``) when ``env`` is a :class:`CollectionEnv`;
    they travel to the trainer with the episode statistics on every backend."""
    env_id = getattr(env, "member_id", None)
    if env_id is None or not episodes:
        return dict(episodes)
    report = env.pop_report_()
    head = f"{ENV_KEY}{env_id}/"
    out = dict(episodes)
    out[head + "return"] = np.asarray(episodes["return"], dtype=np.float64)
    out[head + "length"] = np.asarray(episodes["length"], dtype=np.float64)
    out[head + "fragments"] = np.ones(1)
    out[head + "switch_truncations"] = np.asarray([report["switch_truncations"]], dtype=np.float64)
    for name, values in report["params"].items():
        out[f"{head}param/{name}"] = values.double().numpy()
    return out


__all__ = ["CollectionEnv", "make_actor_env", "switch_member_", "tag_fragment"]
