"""Learners on Ray: :class:`LearnerServer` (the plain :class:`orchestration.learner_host.LearnerHost` in an actor)
and the driver's :class:`RayLearner` (the Learner protocol). Wiring only: what to train on is the learner's inbox.
Fragments arrive as a *nested* object ref, read without a copy; weights go out as one ref per version. Restarts:
the driver registers each learner's state with a :class:`LearnerCheckpoints` actor, which a re-constructed
learner loads first (what it received since counts lost; its versions keep rising). ``learners_per_policy > 1``:
the server is rank 0 of :class:`DataParallelRank` actors. A team critic (:class:`TeamCriticServer`,
:class:`RayTeamCritic`) takes pushes too; it is not restarted.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Mapping, Sequence

import ray
import torch
from tensordict import TensorDict

from core.specs import from_json
from orchestration.config import TrainConfig
from orchestration.data_parallel import DataParallelRank, free_port
from orchestration.learner_checkpoints import LearnerCheckpoints
from orchestration.learner_host import LearnerHost, take_pushed
from orchestration.ray_session import kill_actor
from orchestration.team_critic import TeamCriticLearner, team_critic_settings
from orchestration.wire import from_wire, to_wire


class LearnerServer(LearnerHost):
    """The learner actor of ``policy_id``, started from ``initial_weights`` (None: those registered in
    ``checkpoints``, the registry or its name: a restart might not read an object ref again, ray#53727)."""

    def __init__(self, policy_id: str, config: TrainConfig, tree_json: str, initial_weights: Mapping | None, *,
                 resolve_timeout_s: float = 30.0, num_threads: int = 1, checkpoints: Any = None) -> None:
        checkpoints = ray.get_actor(checkpoints) if isinstance(checkpoints, str) else checkpoints  # or its name
        if initial_weights is None:
            initial_weights = ray.get(_registered(checkpoints, policy_id, resolve_timeout_s)[0])
        super().__init__(policy_id, config, tree_json, initial_weights, num_threads=num_threads, put=ray.put)
        self.resolve_timeout_s, self._checkpoints = resolve_timeout_s, checkpoints
        if checkpoints is not None and _reconstructed():
            info = ray.get(checkpoints.resume.remote(policy_id))
            self.resume_from(info["restarts"], None if info["refs"] is None else ray.get(info["refs"][0]),
                             info["version"])
        self.publish()

    def push(self, meta: Mapping[str, Any], refs: Sequence[ray.ObjectRef]) -> int:
        """One fragment: ``meta`` + ``[ref]`` of its wire message, nested: resolved here or counted lost."""
        return super().push(meta, lambda: ray.get(refs[0], timeout=self.resolve_timeout_s))

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, where the data-parallel group of this policy meets."""
        return ray.util.get_node_ip_address(), free_port()

    def join_data_parallel(self, peers: Sequence[Any], address: str, port: int) -> None:
        """Rank 0 of a group with ``peers`` (:meth:`LearnerHost.join_group`)."""
        self.join_group(peers, address, port, wait=ray.get, send=lambda peer, shard, progress, lr: peer.train.remote(
            ray.put(to_wire(shard)), progress=progress, lr=lr), load=lambda peer, state: peer.load_state_.remote(state))

    def publish(self) -> None:
        super().publish()
        if self._checkpoints is not None:  # fire and forget: the version watermark for a restart
            self._checkpoints.published.remote(self.policy_id, self.learner.version)

    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _reconstructed() -> bool:
    """Whether this actor process is a restart (Ray 2.x reads a deprecated attribute inside: silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class TeamCriticServer(TeamCriticLearner):
    """The team critic in an actor: built from the config like the local one; fragments pushed as refs."""

    def __init__(self, config: TrainConfig, tree_json: str, teams: Sequence, *, resolve_timeout_s: float = 30.0,
                 num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        super().__init__(from_json(tree_json), teams, **team_critic_settings(config))
        self.resolve_timeout_s = resolve_timeout_s

    def push(self, meta: Mapping[str, Any], refs: Sequence[ray.ObjectRef]) -> None:
        """Takes one fragment (``meta`` + ``[ref]`` of its wire message), as :meth:`LearnerServer.push`."""
        take_pushed(self.inbox, meta, lambda: ray.get(refs[0], timeout=self.resolve_timeout_s),
                    lambda fragment: self.file(fragment, meta))

    def wire_values(self) -> dict[int, dict]:
        """:meth:`values` as wire messages (the member learners' ``train`` gets them through one ref)."""
        return {fid: to_wire(td) for fid, td in self.values().items()}


class RayTeamCritic:
    """The driver's handle on the team critic actor (local: the :class:`TeamCriticLearner` itself)."""

    def __init__(self, handle, members: Sequence[str]) -> None:
        self.handle, self.members = handle, set(members)

    def values(self):
        """A ref of the batch's values; Ray resolves it in each member learner's ``train`` call."""
        return self.handle.wire_values.remote()

    def submit(self, progress: float = 0.0, lr: float | None = None) -> _Pending:
        return _Pending(self, self.handle.train.remote(progress, lr))

    def finish(self, ref) -> dict:
        return {"metrics": ray.get(ref)}

    def settle(self, produced: Mapping[int, int]) -> int:
        return ray.get(self.handle.settle.remote(dict(produced)))

    def state(self) -> dict[str, Any]:
        return ray.get(self.handle.state.remote())

    def load_state_(self, state: Mapping[str, Any]) -> None:
        ray.get(self.handle.load_state_.remote(state))

    def close(self) -> None:
        kill_actor(self.handle)


RemoteLearner = ray.remote(LearnerServer)
RemoteTeamCritic = ray.remote(TeamCriticServer)
RemoteLearnerCheckpoints = ray.remote(num_cpus=0)(LearnerCheckpoints)
RemoteRank = ray.remote(DataParallelRank)


class _Pending:
    """A training request sent to a learner actor (``done()`` / ``result()``)."""

    def __init__(self, learner: RayLearner, ref) -> None:
        self.learner, self.ref = learner, ref

    def done(self) -> bool:
        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self) -> dict | None:
        return self.learner.finish(self.ref)


def _registered(checkpoints, policy_id: str, timeout_s: float) -> list:
    """``[ref]`` of ``policy_id``'s initial weights in the registry (the driver's call may land later)."""
    deadline = time.monotonic() + timeout_s
    while (refs := ray.get(checkpoints.initial_weights.remote(policy_id))) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"learner {policy_id!r}: its initial weights were never registered")
        time.sleep(0.01)
    return refs


class RayLearner:
    """The driver's handle on a learner actor (the Learner protocol). Registers the learner's state every
    ``checkpoint_every`` steps and when read; a dead actor is waited for while Ray restarts it from that state."""

    learns = True

    def __init__(self, policy_id: str, handle, registry, *, checkpoint_every: int, restart_timeout_s: float,
                 initial: tuple[int, list], peers: Sequence[Any] = ()) -> None:
        self.policy_id, self.handle, self.registry = policy_id, handle, registry
        self.checkpoint_every, self.restart_timeout_s, self.peers = checkpoint_every, restart_timeout_s, list(peers)
        # ``initial``: ``(0, [ref])``, the actor's first weights: workers start from them meanwhile (:meth:`started`)
        self._published = initial
        self._steps = 0

    def started(self):
        """A ref that resolves once the actor is constructed (``ray.get`` raises its construction error)."""
        return self.handle.published.remote()

    def _get(self, ref):
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self._recover(err)
            return None

    def _call(self, method: str, *args):
        """Calls a learner method; if the learner died, waits for its restart and calls the new incarnation."""
        result = self._get(getattr(self.handle, method).remote(*args))
        return result if result is not None else ray.get(getattr(self.handle, method).remote(*args))

    def _recover(self, err: BaseException) -> None:
        try:  # calls to a restarting actor fail; this one is retried until the actor is back
            ray.get(self.handle.ping.options(max_task_retries=-1).remote(), timeout=self.restart_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as again:
            raise RuntimeError(f"learner {self.policy_id!r} died and was not restarted "
                               f"(RayConfig.max_learner_restarts)") from again
        warnings.warn(f"learner {self.policy_id!r} died ({type(err).__name__}); it resumed from its last checkpoint",
                      RuntimeWarning, stacklevel=2)
        self._published = ray.get(self.handle.published.remote())

    def finish(self, ref) -> dict | None:
        """A training request's result (None: no batch, or the learner died and lost it); new weights taken."""
        result = self._get(ref)
        if result is not None:
            self._published = (result["version"], result["weights"])
            self._steps += 1
            if self.checkpoint_every and self._steps % self.checkpoint_every == 0:
                self.snapshot()
        return result

    # -- the Learner protocol ----------------------------------------------------------------------------
    def receive(self, fragment: TensorDict, meta: Mapping[str, Any]) -> None:
        """A fragment made in this process (external envs), put and pushed without waiting (calls stay ordered)."""
        self.handle.push.remote(dict(meta), [ray.put(to_wire(fragment, meta))])

    def submit(self, progress: float = 0.0, lr: float | None = None, take_all: bool = False,
               team_values=None) -> _Pending:
        return _Pending(self, self.handle.train.remote(progress, lr, take_all, team_values))

    def published(self) -> tuple[int, list]:
        return self._published

    def weights(self) -> tuple[int, TensorDict]:
        version, refs = self._published
        return version, from_wire(ray.get(refs[0]))

    def new_steps(self) -> int:
        return self._call("new_steps")

    def settle(self, produced: Mapping[int, int]) -> int:
        return self._call("settle", dict(produced))

    def report(self) -> dict[str, Any]:
        return self._call("report")

    def state(self) -> dict[str, Any]:
        """The learner's state (also registered as the checkpoint a restarted learner resumes from)."""
        return self.snapshot()

    def load_state_(self, state: Mapping[str, Any]) -> None:
        self._published = self._call("load_state", state)
        self.snapshot()  # a crash from now on resumes the restored state

    def snapshot(self) -> dict[str, Any]:
        """The learner's state, registered (a driver-owned copy) for restarts."""
        state = self._call("state")
        ray.get(self.registry.save.remote(self.policy_id, [ray.put(state)], state["version"]))
        return state

    def close(self) -> None:
        for handle in [self.handle, *self.peers]:
            kill_actor(handle)


__all__ = ["DataParallelRank", "LearnerCheckpoints", "LearnerServer", "RayLearner", "RayTeamCritic",
           "RemoteLearner", "RemoteLearnerCheckpoints", "RemoteRank", "RemoteTeamCritic", "TeamCriticServer"]
