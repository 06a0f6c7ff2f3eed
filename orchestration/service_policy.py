"""Central inference for actors (seed 003): a stand-in for a policy that asks an inference service for actions.

With ``rollout.central_inference`` the actors of a fleet hold no policy copy of their own: each step's
``act_step`` becomes one request to a shared :class:`orchestration.inference.InferenceService` (in this
process on the local backend; a Ray actor hosting one, :mod:`orchestration.ray_fleet`, on Ray), which
batches the requests of every actor into one forward pass, on the GPU when there is one. Weights handed to an
actor go to the service (newer versions only), which swaps them in between two batches.

Versions: an actor labels its fragment with the oldest version the service answered its steps with (a service
shared by several actors may act with a newer one than this actor was handed), so the label is the lag of the
fragment's oldest step, and every step's behaviour log-probability is the one of the weights that acted.

Usage (what :func:`orchestration.builder.build_actor` does)::

    service = InferenceService(policies).start()
    stand_ins = {pid: ServicePolicy(pid, service, policies[pid]) for pid in policies}
    actor = Actor(env, stand_ins, assignment)               # acts through the service
    actor.set_weights(pid, version, weights)                # forwarded to the service
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
from tensordict import TensorDictBase

from core.layout import ACTION, LOG_PROB, NEXT, RECURRENT_STATE
from core.policies import GroupPolicy
from orchestration.inference import InferenceConfig, InferenceResult, InferenceService
from orchestration.wire import from_wire, to_wire


class ActionService(Protocol):
    """What a :class:`ServicePolicy` needs of a service (:class:`orchestration.inference.InferenceService`)."""

    versions: dict[str, int]

    def act(self, policy_id: str, obs: Any, **kwargs: Any) -> Any: ...

    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase, force: bool = False) -> None: ...

    def weights(self, policy_id: str) -> TensorDictBase: ...


class ServicePolicy:
    """Acts for ``policy_id`` through ``service``; the Actor sees the policy interface it uses.

    Args:
        policy_id: the policy the service serves under this id.
        service: an :class:`ActionService`.
        like: a module of the policy's architecture (its agent count and recurrence are read, nothing else).
        timeout_s: deadline of every request.
    """

    defers_log_prob = False

    def __init__(self, policy_id: str, service: ActionService, like: GroupPolicy, *, timeout_s: float = 60.0) -> None:
        self.policy_id, self.service, self.timeout_s = policy_id, service, timeout_s
        self.num_agents = like.num_agents
        self.recurrent = like.recurrent  # the Actor carries recurrent state only for recurrent policies
        self.reads_episode_starts = like.recurrent
        self.config = like.config
        self._oldest_acted: int | None = None  # since the last take_oldest_acted()

    def act_step(self, obs, shared=None, generator: torch.Generator | None = None, deterministic: bool = False,
                 recurrent_state: torch.Tensor | None = None, episode_start: torch.Tensor | None = None,
                 with_value: bool = False, with_log_prob: bool = True) -> dict:
        """One request: ``{"action", "log_prob"}`` (and the recurrent states) for ``obs`` ``[E, A, ...]``.

        ``generator`` is unused: the service samples with its own seeded generator."""
        if with_value:
            raise ValueError(f"policy {self.policy_id!r}: an inference service computes no values")
        result = self.service.act(self.policy_id, obs, shared=shared, timeout_s=self.timeout_s,
                                  deterministic=deterministic, recurrent_state=recurrent_state,
                                  episode_start=episode_start)
        out = {ACTION: result.action, LOG_PROB: result.log_prob}
        oldest = self._oldest_acted
        self._oldest_acted = result.version if oldest is None or result.version < oldest else oldest
        if self.recurrent:
            out[RECURRENT_STATE] = result.recurrent_state
            out[NEXT] = {RECURRENT_STATE: result.next_recurrent_state}
        return out

    def take_oldest_acted(self) -> int | None:
        """The oldest version that answered since the last call (None: none did): a fragment's label."""
        oldest, self._oldest_acted = self._oldest_acted, None
        return oldest

    def load_weights_(self, version: int, weights: TensorDictBase, force: bool = False) -> None:
        """Hands ``weights`` to the service unless it acts with that version or a newer one already (``force``:
        even then, e.g. a restored checkpoint that republishes a version number)."""
        if force or version > self.service.versions.get(self.policy_id, -1):
            self.service.set_weights(self.policy_id, version, weights, force)

    def weights(self) -> TensorDictBase:
        """The weights the service acts with."""
        return self.service.weights(self.policy_id)


def fragment_versions(policies: Mapping[str, Any], handed: Mapping[str, int]) -> dict[str, int]:
    """A fragment's policy versions: ``handed`` (what its actor was handed), and where a stand-in asked a service
    for the fragment's steps, the oldest version that answered them (the service may have moved on)."""
    out = dict(handed)
    for pid, policy in policies.items():
        if isinstance(policy, ServicePolicy) and (acted := policy.take_oldest_acted()) is not None:
            out[pid] = acted
    return out


class InferenceServer:
    """An inference service in a process of its own (a Ray actor, :mod:`orchestration.ray_fleet`), weights in
    and out as wire messages (``policies``: policy id -> module with the initial weights)."""

    def __init__(self, policies: Mapping[str, Any], config: InferenceConfig) -> None:
        self.service = InferenceService(policies, config).start()

    def act(self, policy_id: str, obs: Any, kwargs: Mapping[str, Any]) -> InferenceResult:
        return self.service.act(policy_id, obs, **kwargs)

    def set_weights(self, policy_id: str, version: int, message: Mapping[str, Any], force: bool = False) -> None:
        self.service.set_weights(policy_id, version, from_wire(message, copy=True), force)

    def versions(self) -> dict[str, int]:
        return self.service.versions

    def weights(self, policy_id: str) -> dict:
        return to_wire(self.service.weights(policy_id))

    def stats(self) -> dict[str, float]:
        return self.service.stats()


__all__ = ["ActionService", "InferenceServer", "ServicePolicy", "fragment_versions"]
