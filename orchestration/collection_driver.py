"""The collection state of a run (seed 002), held by the trainer: which member each actor runs, per-env episode
metrics, and the structure's state (curriculum promotion, adversarial returns).

Usage loop (what :class:`orchestration.trainer.Trainer` does each iteration)::

    driver = CollectionDriver.from_config(config)        # None-free: only built when config.collection is set
    fleet.set_env_ids(driver.draw_())                    # one member per actor, switched at its next boundary
    ...                                                  # collect and train
    metrics.update(driver.observe_(drained["episodes"])) # pops the per-env entries; collection.update(...)
    state = driver.state(); driver.load_state_(state)    # checkpoints: structure state, generator, windows

The draws use a ``torch.Generator`` owned here (seeded from the run's seed), so a resumed run draws what the
uninterrupted one would have. Metrics (every env id of the collection, every iteration):
``episode_return_mean/env:<id>``, ``episode_length_mean/env:<id>`` (last ``window`` finished episodes of that
env), ``episodes/env:<id>`` (finished in the iteration), ``collection/fragments/env:<id>``,
``collection/actors/env:<id>``, ``collection/switch_truncations`` (running total); a curriculum adds
``collection/unlocked/env:<id>`` and ``collection/mastered/env:<id>`` (0 or 1), an adversarial set
``collection/prob/env:<id>``, a prior ``collection/param/<name>_mean`` and ``_std`` over the iteration's draws.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from core.envsets import AdversarialSet, Curriculum, CurriculumState, EnvCollection
from orchestration.collection_env import switch_member_
from orchestration.env_collection import ENV_KEY, load_collection

_DRAW_STREAM = 7_777_777  # the driver's generator: run seed + this


class CollectionDriver:
    """Draws members for ``num_actors`` actors and follows per-env episode metrics (module docstring).

    Args:
        collection: the run's collection.
        num_actors: actors (rollout workers) drawn for each iteration.
        seed: the run's seed.
        window: finished episodes per env the per-env means run over.
    """

    def __init__(self, collection: EnvCollection, num_actors: int, seed: int, window: int = 100) -> None:
        self.collection, self.num_actors, self.window = collection, num_actors, window
        self.state: Any = collection.initial_state()
        self.generator = torch.Generator().manual_seed(seed + _DRAW_STREAM)
        self.assigned: list[str] = []
        """The member each actor was given for the current iteration."""
        self.history: dict[str, dict[str, deque]] = {
            env_id: {"return": deque(maxlen=window), "length": deque(maxlen=window)} for env_id in collection.ids}
        self.switch_truncations = 0

    @classmethod
    def from_config(cls, config) -> "CollectionDriver":
        """The driver of a config whose collection was resolved (:func:`orchestration.env_collection.with_collection`)."""
        return cls(load_collection(config, trusted=True), config.rollout.num_workers, config.seed)

    def draw_(self) -> list[str]:
        """One member per actor for the next iteration (``collection.draw``; advances the generator)."""
        self.assigned = list(self.collection.draw(self.state, self.num_actors, self.generator))
        return self.assigned

    def observe_(self, episodes: dict[str, list]) -> dict[str, float]:
        """Pops the per-env entries (``env:<id>/...``) out of an iteration's drained episodes, records them,
        updates the structure's state with the per-env metrics of the envs that finished episodes, and returns
        the iteration's collection metrics (module docstring)."""
        ids = self.collection.ids
        new, fragments = dict.fromkeys(ids, 0), dict.fromkeys(ids, 0)
        params: dict[str, list[float]] = {}
        for key in [k for k in episodes if k.startswith(ENV_KEY)]:
            values = episodes.pop(key)
            env_id, what = key[len(ENV_KEY):].split("/", 1)
            if env_id not in self.history:
                raise ValueError(f"episodes of env id {env_id!r}, which is no member of the collection {ids}")
            if what in ("return", "length"):
                self.history[env_id][what].extend(float(v) for v in values)
                new[env_id] += len(values) if what == "return" else 0
            elif what == "fragments":
                fragments[env_id] += len(values)
            elif what == "switch_truncations":
                self.switch_truncations += int(sum(values))
            elif what.startswith("param/"):
                params.setdefault(what.removeprefix("param/"), []).extend(float(v) for v in values)
        self.state = self.collection.update(self.state, {e: self.env_metrics(e, new[e]) for e in ids if new[e]})
        out: dict[str, float] = {"collection/switch_truncations": float(self.switch_truncations)}
        for env_id in ids:
            tag = f"env:{env_id}"
            out[f"episode_return_mean/{tag}"] = _mean(self.history[env_id]["return"])
            out[f"episode_length_mean/{tag}"] = _mean(self.history[env_id]["length"])
            out[f"episodes/{tag}"] = float(new[env_id])
            out[f"collection/fragments/{tag}"] = float(fragments[env_id])
            out[f"collection/actors/{tag}"] = float(self.assigned.count(env_id))
        for name, values in sorted(params.items()):
            out[f"collection/param/{name}_mean"] = float(np.mean(values))
            out[f"collection/param/{name}_std"] = float(np.std(values))
        out.update(self.state_metrics())
        return out

    def env_metrics(self, env_id: str, episodes: int = 0) -> dict[str, float]:
        """The per-env metrics a structure may name (:data:`orchestration.env_collection.PER_ENV_METRICS`)."""
        mean_return, mean_length = _mean(self.history[env_id]["return"]), _mean(self.history[env_id]["length"])
        return {"mean_return": mean_return, "episode_return_mean": mean_return, "mean_length": mean_length,
                "episode_length_mean": mean_length, "episodes": float(episodes)}

    def state_metrics(self) -> dict[str, float]:
        """Where the structure stands: unlocked/mastered stages, or adversarial draw probabilities."""
        structure, out = self.collection.structure, {}
        if isinstance(structure, Curriculum):
            for env_id in structure.stages:
                out[f"collection/unlocked/env:{env_id}"] = float(env_id in self.state.unlocked)
                out[f"collection/mastered/env:{env_id}"] = float(env_id in self.state.mastered)
        elif isinstance(structure, AdversarialSet):
            for env_id, p in zip(structure.ids, structure.probabilities(self.state).tolist()):
                out[f"collection/prob/env:{env_id}"] = p
        return out

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"json": structure state, windows, counters, "rng": generator state}`` (JSON-able but ``rng``)."""
        state = self.state
        if isinstance(state, CurriculumState):
            encoded: Any = {"unlocked": sorted(state.unlocked), "mastered": sorted(state.mastered)}
        elif isinstance(state, Mapping):
            encoded = {k: float(v) for k, v in state.items()}
        else:
            encoded = None
        history = {e: {k: list(v) for k, v in h.items()} for e, h in self.history.items()}
        return {"json": {"state": encoded, "history": history, "switch_truncations": self.switch_truncations,
                         "assigned": list(self.assigned)},
                "rng": self.generator.get_state()}

    def load_state_(self, saved: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict` output (taken with the same collection).

        Raises:
            ValueError: the saved state names env ids this collection lacks.
        """
        data, structure = saved["json"], self.collection.structure
        encoded = data["state"]
        if isinstance(structure, Curriculum):
            self.state = CurriculumState(unlocked=frozenset(encoded["unlocked"]), mastered=frozenset(encoded["mastered"]))
            structure.training_ids(self.state)  # checks the ids
        elif isinstance(structure, AdversarialSet):
            structure.probabilities(encoded)  # checks the ids
            self.state = dict(encoded)
        for env_id, windows in data["history"].items():
            if env_id not in self.history:
                raise ValueError(f"checkpoint: collection state of env id {env_id!r}, which is no member of "
                                 f"this run's collection {self.collection.ids}")
            for key, values in windows.items():
                self.history[env_id][key].extend(values)
        self.switch_truncations = int(data["switch_truncations"])
        self.assigned = list(data.get("assigned", []))
        self.generator.set_state(saved["rng"])


def evaluate_members(actor, env_ids: Sequence[str], episodes: int,
                     summarize: Callable[[Mapping[str, list[float]]], dict[str, float]]) -> dict[str, float]:
    """Evaluation over a collection: ``episodes`` episodes in each of ``env_ids`` (each started afresh).

    Returns:
        ``summarize`` of all episodes together, plus ``summarize`` of each env's with ``/env:<id>`` appended
        to every key (``eval_return_mean/env:test``).
    """
    out: dict[str, float] = {}
    together: dict[str, list[float]] = {}
    for env_id in env_ids:
        switch_member_(actor, env_id, force=True)
        returns = actor.run_episodes(episodes)
        out.update({f"{key}/env:{env_id}": value for key, value in summarize(returns).items()})
        for key, values in returns.items():
            together.setdefault(key, []).extend(values)
    out.update(summarize(together))
    return out


def _mean(values) -> float:
    return float(sum(values) / len(values)) if len(values) else math.nan


__all__ = ["CollectionDriver", "evaluate_members"]
