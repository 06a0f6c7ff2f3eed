"""The weights an inference service acts with (:mod:`orchestration.inference`): staged by the learner at any
time, from any thread, and loaded by the serving thread between batches only, so that no batch mixes versions.

Usage::

    weights = StagedWeights({"agents": policy}, {"agents": 0}, torch.device("cpu"))
    weights.stage("agents", 3, new)        # any thread (entries and shapes checked against the policy)
    swapped = weights.swap()               # the serving thread, before each batch: loads what is staged
    weights.policies["agents"], weights.versions["agents"]   # what the batch acts with
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from core.policies import GroupPolicy
from orchestration.inference_requests import check_weights


class StagedWeights:
    """Policy id -> the service's own copy of the policy (on ``device``), the version it acts with, and the weights
    staged for the next batch (``TensorDict.from_module`` layout).

    Args:
        policies: policy id -> module (copied).
        versions: policy id -> version of the given weights (absent: 0).
        device: where the copies live.
    """

    def __init__(self, policies: Mapping[str, GroupPolicy], versions: Mapping[str, int],
                 device: torch.device) -> None:
        self.device = device
        self.policies = {pid: copy.deepcopy(p).to(device).eval() for pid, p in policies.items()}
        self._templates = {pid: TensorDict.from_module(p) for pid, p in self.policies.items()}
        unknown = set(versions) - set(self.policies)
        if unknown:
            raise KeyError(f"versions of unknown policy ids {sorted(unknown)}: "
                           f"the service serves {sorted(self.policies)}")
        self.versions = {pid: int(versions.get(pid, 0)) for pid in self.policies}
        self._pending: dict[str, tuple[int, TensorDictBase]] = {}
        self._lock = threading.Lock()

    def template(self, policy_id: str) -> TensorDictBase:
        """The weights ``policy_id`` acts with (the module's own parameters); KeyError naming the policy ids
        served for an unknown one."""
        if policy_id not in self.policies:
            raise KeyError(f"unknown policy id {policy_id!r}: this service serves {sorted(self.policies)}")
        return self._templates[policy_id]

    def stage(self, policy_id: str, version: int, weights: TensorDictBase, force: bool = False) -> bool:
        """Stages a copy of ``weights`` as ``version`` (a later call before :meth:`swap` wins), unless the service
        has that version or a newer one staged or acting: versions only rise, so callers that are behind (a
        rollout worker handed an older version than another) never turn it back. ``force``: stage even so (a
        restored learner that republishes a version). Returns whether it staged."""
        check_weights(policy_id, self.template(policy_id), weights)
        if not force and int(version) <= self._newest(policy_id):  # (checked again below, with the copy made)
            return False
        staged = weights.detach().to(self.device).clone()  # ours: the caller may reuse its tensors at once
        with self._lock:
            if not force and int(version) <= self._newest(policy_id):
                return False
            self._pending[policy_id] = (int(version), staged)
        return True

    def _newest(self, policy_id: str) -> int:
        """The version staged, else the one acting."""
        return self._pending.get(policy_id, (self.versions[policy_id],))[0]

    def swap(self) -> int:
        """Loads what is staged into the policies (the serving thread, between batches); how many it loaded."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for pid, (version, weights) in pending.items():
            self._templates[pid].update_(weights)  # copies into the module's own parameters
            self.versions[pid] = version
        return len(pending)

    def current(self, policy_id: str) -> TensorDictBase:
        """A CPU copy of the weights ``policy_id`` acts with."""
        return self.template(policy_id).detach().cpu().clone()

    def latest(self, policy_id: str, weights: bool = True) -> tuple[int, TensorDictBase | None]:
        """``(version, CPU copy of the weights)``: the newest staged, else the current ones (``weights=False``:
        None for them, no copy)."""
        with self._lock:
            pending = self._pending.get(policy_id)
        if pending is not None:
            return pending[0], pending[1].detach().cpu().clone() if weights else None
        return self.versions[policy_id], self.current(policy_id) if weights else None


__all__ = ["StagedWeights"]
