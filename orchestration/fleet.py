"""Fleets (seed 004): where fragments come from. A fleet runs actors, delivers every fragment they produce to
the learners (``learner.receive(fragment, meta)``), and takes new weights.

The Fleet protocol, which every backend implements (:class:`LocalFleet` here: in-process actors;
:class:`orchestration.ray_fleet.RayFleet`: rollout workers as Ray actors). Usage loop (what
:class:`orchestration.trainer.Trainer` does)::

    reports = fleet.collect(steps, weights, fresh_steps)   # sync: >= steps env steps delivered, acting with weights
    fleet.start(weights)                                   # async: begin producing
    fleet.pump(weights, hungry)                            # async: let it produce (local: one fragment per actor;
                                                           #   hungry: a learner waits for data)
    fleet.trained(fragment_ids, learner)                   # async: what a learner is done with (Ray: frees credit)
    fleet.broadcast({pid: (version, weights)})             # new weights, loaded at each actor's next fragment
    fleet.set_env_ids(["easy", "hard"])                    # collections: each actor's member, from its next fragment
    episodes = fleet.episodes()                            # completed since the last call, per key
    fleet.interrupt()                                      # from a signal handler: a waiting collect gives up
    fleet.stop(); fleet.close()

``weights`` maps policy id -> ``(version, weights)`` in the form the learners publish (a TensorDict locally,
an object-store ref on Ray; a Ray fleet puts TensorDicts it is handed in the object store itself).
Bookkeeping every fleet keeps for the fragment accounting (:func:`orchestration.statistics.fragment_accounting`):
``reported`` (worker id -> fragments produced), ``dead`` (ids of dead workers) and ``restarts``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

from tensordict import TensorDictBase

from orchestration.actor import Actor
from orchestration.collection_env import switch_member_, tag_fragment
from orchestration.config import TrainConfig
from orchestration.past_selves import past_selves_report
from orchestration.statistics import EpisodeStatistics

#: policy id -> (version, weights in the fleet's transport form)
Weights = Mapping[str, tuple[int, Any]]



def fragment_rounds(steps: int, fragment_steps: int, workers: int) -> int:
    """Rounds of one fragment per worker that deliver at least ``steps`` env steps: the synchronous collection
    rule of every fleet (each worker the same number of fragments, as a local run), and the top-up a Ray fleet
    asks of its live workers after others died."""
    return math.ceil(max(steps, 0) / (fragment_steps * workers))


def one_per_worker(config: TrainConfig, env_ids: Sequence[str], workers: int) -> list[str]:
    """``env_ids`` as a list, refused unless the run has a collection and they name one member per worker
    (``Fleet.set_env_ids``, on every backend)."""
    if not config.collection:
        raise ValueError(f"cannot switch to collection members {list(env_ids)}: this run's env ({config.env}) is not "
                         f"a collection (a run of one is built with --collection FILE)")
    if len(env_ids) != workers:
        raise ValueError(f"set_env_ids takes one collection member per worker ({workers}), got {len(env_ids)}: "
                         f"{list(env_ids)}")
    return list(env_ids)


def collect_in_rounds(target_steps: int, fragment_steps: int, workers: int,
                      run_rounds: Callable[[dict[int, int]], list[dict]], fresh_steps: Callable[[], int] | None,
                      attempts: int = 1) -> list[dict]:
    """Every fleet's synchronous collection: :func:`fragment_rounds` of one fragment per worker for
    ``target_steps``; ``run_rounds({worker index: rounds})`` has the workers collect them and returns their
    reports. What dead workers lost (a fleet that re-creates them) is topped up: while ``fresh_steps()`` (the
    steps the learners hold; None: nothing learns, nothing to top up) is short of the target, every worker adds
    the rounds the shortfall needs, up to ``attempts`` collections in all.

    Raises:
        RuntimeError: the target was still short after ``attempts`` collections.
    """
    reports: list[dict] = []
    missing = target_steps
    for _ in range(attempts):
        reports += run_rounds(dict.fromkeys(range(workers), fragment_rounds(missing, fragment_steps, workers)))
        missing = target_steps - fresh_steps() if fresh_steps is not None else 0
        if missing <= 0:
            return reports
    raise RuntimeError(f"could not collect a training batch: {missing} env steps short after {attempts} tries")


def resume_gaps(config: TrainConfig, envs_save_state: bool, restarts: int) -> list[str]:
    """Why a run resumed from a checkpoint of this fleet would not continue bit for bit, said to its user ([]: it
    would): asynchronous mode, central inference, envs that cannot save their state, a re-created worker."""
    return [why for gap, why in (
        (config.mode != "sync", "asynchronous mode: fragments waiting in a learner's pool and in flight at the "
         "checkpoint are not restored"),
        (config.rollout.central_inference, "the central inference service's sampling stream is not saved (actions "
         "are drawn afresh)"),
        (not envs_save_state, "envs that cannot save their state were reset (a new episode starts in every env)"),
        (restarts > 0, "a rollout worker was re-created, so the workers' states are not saved (its stream cannot "
         "go on under a fresh fleet's ids)")) if gap]


def worker_states_saved(config: TrainConfig, restarts: int, collecting: bool) -> bool:
    """Whether a fleet's worker states may go in a checkpoint: not in asynchronous mode nor after a collection
    that failed (a worker may be mid-fragment), nor after a worker was re-created (see :func:`resume_gaps`);
    a resumed run then restarts its envs and counts."""
    return config.mode == "sync" and not restarts and not collecting


class CollectionInterrupted(Exception):
    """A collection given up on :meth:`Fleet.interrupt` (one that waited for data that did not come): the
    iteration did not happen and nothing is counted."""


class Fleet(Protocol):
    """The fleet interface (module docstring)."""

    fragment_steps: int
    reported: dict[int, int]
    dead: set[int]
    restarts: int
    resume_gaps: Sequence[str]

    def collect(self, target_steps: int, weights: Weights, fresh_steps: Callable[[], int] | None) -> list[dict]: ...

    def start(self, weights: Weights) -> None: ...

    def pump(self, weights: Weights, hungry: bool = False) -> None: ...

    def trained(self, fragment_ids: Sequence[int], learner: str = "") -> None: ...

    def broadcast(self, weights: Weights, wait: bool = False, force: bool = False) -> None: ...

    def set_env_ids(self, env_ids: Sequence[str]) -> None: ...

    def episodes(self) -> dict[str, Any]: ...

    def monitors(self) -> list[dict]: ...

    def actor_weights(self, policy_id: str) -> list[TensorDictBase]: ...

    def state(self) -> list[dict]: ...

    def load_state_(self, states: Sequence[Mapping[str, Any]]) -> None: ...

    def interrupt(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


class LocalFleet:
    """Actors in this process, stepped one after the other (Sample Factory's serial mode).

    Synchronous mode: every actor loads the given weights, then the actors produce rounds of one fragment
    each until the target is reached. Asynchronous mode, deterministic under a seed: each :meth:`pump` is one
    round, and an actor loads the newest weights it was handed only at its own fragment boundary, so data
    produced before a training step reaches the learner after it, as on a real asynchronous fleet.

    Args:
        config: the run's config (its mode and central inference say whether a resume is exact).
        actors: the training actors (one per worker; worker id = index).
        learners: policy id -> learner that receives every fragment (the learning ones).
        stats: where completed episodes go (a fresh :class:`EpisodeStatistics` when None).
    """

    restarts = 0

    def __init__(self, config: TrainConfig, actors: Sequence[Actor], learners: Mapping[str, Any],
                 stats: EpisodeStatistics | None = None) -> None:
        self.config, self.actors, self.learners = config, list(actors), dict(learners)
        self.stats = stats or EpisodeStatistics()
        first = self.actors[0]
        streams = len(first.sequences())  # a polling actor: one fragment stream per env process, equal sizes
        self.fragment_steps = first.env.num_envs // streams * first.fragment_length
        self.reported: dict[int, int] = {}
        self.dead: set[int] = set()
        self._latest: dict[str, tuple[int, Any]] = {}

    def _produce(self, actor: Actor) -> dict:
        fragment = actor.collect()
        meta = actor.fragment_meta(fragment)
        for learner in self.learners.values():
            learner.receive(fragment, meta)
        self.stats.add(meta["worker_id"], meta["sequence"], tag_fragment(actor.completed_episodes(), actor.env))
        self.reported[meta["worker_id"]] = meta["sequence"] + 1
        return meta

    def _load(self, actor: Actor, weights: Weights, force: bool = False) -> None:
        for pid, (version, w) in weights.items():
            if pid in actor.policies:
                actor.set_weights(pid, version, w, force=force)

    def _report(self, actor: Actor) -> dict:
        return {"worker_id": actor.worker_id, "produced": sum(self.reported.get(w, 0) for w in actor.sequences()),
                "push_failures": 0,
                "monitor": {}, "env_counters": dict(getattr(actor.env, "counters", {})),
                "past_selves": past_selves_report(actor)}

    # -- synchronous mode --------------------------------------------------------------------------------
    def collect(self, target_steps: int, weights: Weights, fresh_steps: Callable[[], int] | None = None) -> list[dict]:
        """Every actor loads ``weights``, then rounds of one fragment per actor until ``target_steps``."""
        for actor in self.actors:
            self._load(actor, weights)

        def run_rounds(rounds: dict[int, int]) -> list[dict]:  # nobody dies here: every actor the same rounds
            for _ in range(max(rounds.values())):
                for actor in self.actors:
                    self._produce(actor)
            return [self._report(actor) for actor in self.actors]

        return collect_in_rounds(target_steps, self.fragment_steps, len(self.actors), run_rounds, None)

    # -- asynchronous mode -------------------------------------------------------------------------------
    def start(self, weights: Weights) -> None:
        """Records the weights the actors load at their next fragment boundary."""
        self._latest.update(weights)

    def pump(self, weights: Weights | None = None, hungry: bool = False) -> None:
        """One round: each actor loads the newest weights it was handed, then produces one fragment."""
        for actor in self.actors:
            self._load(actor, self._latest)
            self._produce(actor)

    def trained(self, fragment_ids: Sequence[int], learner: str = "") -> None:
        """Nothing to do: the actors produce only when pumped."""

    def broadcast(self, weights: Weights, wait: bool = False, force: bool = False) -> None:
        """Hands new weights to every actor: loaded at its next fragment boundary, or now with ``wait``
        (``force``: even where the actor holds that version number already, e.g. a restored checkpoint)."""
        self._latest.update(weights)
        if wait:
            for actor in self.actors:
                self._load(actor, weights, force)

    def set_env_ids(self, env_ids: Sequence[str]) -> None:
        """Actor ``i`` acts in collection member ``env_ids[i]`` from its next fragment on (every actor is at a
        fragment boundary between calls: the switch happens now; :func:`switch_member_`)."""
        for actor, env_id in zip(self.actors, one_per_worker(self.config, env_ids, len(self.actors))):
            switch_member_(actor, env_id)

    # -- statistics, state -------------------------------------------------------------------------------
    def episodes(self) -> dict[str, Any]:
        """Episodes completed since the last call (:meth:`EpisodeStatistics.drain`)."""
        return self.stats.drain()

    def monitors(self) -> list[dict]:
        """Each actor's report (no pipeline stages to time in one thread; the env's fault counters)."""
        return [self._report(actor) for actor in self.actors]

    def actor_weights(self, policy_id: str) -> list[TensorDictBase]:
        """The weights every actor acts with for ``policy_id``."""
        return [actor.policy_weights(policy_id) for actor in self.actors]

    def state(self) -> list[dict]:
        """Every actor's :meth:`Actor.state`."""
        return [actor.state() for actor in self.actors]

    def load_state_(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Inverse of :meth:`state`; the produced-fragment counts follow the actors' sequence numbers."""
        for actor, state in zip(self.actors, states):
            actor.load_state_(state)
            self.reported.update(actor.sequences())

    @property
    def resume_gaps(self) -> list[str]:
        """Why a resumed run would not continue bit for bit (:func:`resume_gaps`)."""
        return resume_gaps(self.config, all(hasattr(actor.env, "state_dict") for actor in self.actors), 0)

    def interrupt(self) -> None:
        """Nothing to give up: a local collection ends by itself."""

    def stop(self) -> None:
        """Nothing runs between calls."""

    def close(self) -> None:
        """Closes the actors' envs."""
        for actor in self.actors:
            close = getattr(actor.env, "close", None)
            if close is not None:
                close()


__all__ = ["CollectionInterrupted", "Fleet", "LocalFleet", "Weights", "collect_in_rounds", "fragment_rounds",
           "resume_gaps", "worker_states_saved"]
