"""Ray wiring of central inference (``rollout.central_inference`` on the Ray backend): one actor hosting an
:class:`orchestration.inference.InferenceService`, and the proxy rollout workers hand to their
:class:`orchestration.service_policy.ServicePolicy` stand-ins. No training decision lives here.

The server is a threaded actor: each worker's request runs in one of its threads and waits on the service,
which forms batches across all of them. Weights arrive as object-store refs of their wire form.
"""

from __future__ import annotations

from typing import Any, Mapping

import ray
from tensordict import TensorDictBase

from orchestration.inference import InferenceConfig, InferenceResult, InferenceService
from orchestration.wire import from_wire, to_wire


class InferenceServer:
    """An inference service in its own process (``policies``: policy id -> module with the initial weights)."""

    def __init__(self, policies: Mapping[str, Any], config: InferenceConfig) -> None:
        self.service = InferenceService(policies, config).start()

    def act(self, policy_id: str, obs: Any, kwargs: Mapping[str, Any]) -> InferenceResult:
        return self.service.act(policy_id, obs, **kwargs)

    def set_weights(self, policy_id: str, version: int, message: Mapping[str, Any]) -> None:
        self.service.set_weights(policy_id, version, from_wire(message, copy=True))

    def versions(self) -> dict[str, int]:
        return self.service.versions

    def weights(self, policy_id: str) -> dict:
        return to_wire(self.service.weights(policy_id))

    def stats(self) -> dict[str, float]:
        return self.service.stats()


#: One thread per concurrent caller (rollout worker); more callers queue in Ray.
RemoteInferenceServer = ray.remote(max_concurrency=64)(InferenceServer)


class RemoteService:
    """A rollout worker's handle on the server, with the :class:`orchestration.service_policy.ActionService`
    methods (each call waits for its answer)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._sent: dict[str, int] = {}

    @property
    def versions(self) -> dict[str, int]:
        """Versions this worker handed over (the server dedups; asking it per step would cost a round trip)."""
        return dict(self._sent)

    def act(self, policy_id: str, obs: Any, **kwargs: Any) -> InferenceResult:
        return ray.get(self.handle.act.remote(policy_id, obs, kwargs))

    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase) -> None:
        ray.get(self.handle.set_weights.remote(policy_id, version, to_wire(weights)))
        self._sent[policy_id] = version

    def weights(self, policy_id: str) -> TensorDictBase:
        return from_wire(ray.get(self.handle.weights.remote(policy_id)), copy=True)


__all__ = ["InferenceServer", "RemoteInferenceServer", "RemoteService"]
