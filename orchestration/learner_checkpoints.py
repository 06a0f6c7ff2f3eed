"""The registry a restarted Ray learner resumes from (:mod:`orchestration.ray_learner` makes it an actor):
per policy, the weights it started from and the driver's latest learner state (object refs, kept opaque
here), the highest version published and the restarts so far. Plain bookkeeping, no Ray calls."""

from __future__ import annotations

from typing import Any, Sequence


class LearnerCheckpoints:
    """Per policy: the driver's latest learner state (a ref), the highest version published, restarts."""

    def __init__(self) -> None:
        self.refs: dict[str, list] = {}
        self.initial: dict[str, list] = {}
        self.versions: dict[str, int] = {}
        self.restarts: dict[str, int] = {}

    def set_initial(self, policy_id: str, refs: Sequence[Any]) -> None:
        """``[ref]`` of the weights ``policy_id``'s learner starts from (its constructor reads them here)."""
        self.initial[policy_id] = list(refs)

    def initial_weights(self, policy_id: str) -> list | None:
        return self.initial.get(policy_id)

    def save(self, policy_id: str, refs: Sequence[Any], version: int) -> None:
        self.refs[policy_id] = list(refs)
        self.published(policy_id, version)

    def published(self, policy_id: str, version: int) -> None:
        self.versions[policy_id] = max(self.versions.get(policy_id, 0), int(version))

    def resume(self, policy_id: str) -> dict[str, Any]:
        self.restarts[policy_id] = self.restarts.get(policy_id, 0) + 1
        return {"refs": self.refs.get(policy_id), "version": self.versions.get(policy_id, 0),
                "restarts": self.restarts[policy_id]}


__all__ = ["LearnerCheckpoints"]
