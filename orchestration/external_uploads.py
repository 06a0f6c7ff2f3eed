"""The server's side of local policies (docs/external-protocol.md, "Local policies"): simulators that act with
their own copy of the policies fetch it (``get_policy``) and upload what happened (``trajectory``).

A mixin of :class:`orchestration.external_server.ExternalServer` (it reads the server's config, codec, lanes,
service and counters); kept apart because it is one concept: off-policy data arriving as whole steps.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from adapters.external.messages import ProtocolError, encode, field, name_field
from orchestration.external_episodes import Episode


class LocalPolicyHandlers:
    """``get_policy`` and ``trajectory`` messages of one connection (called from its thread)."""

    def _send_policy(self, ws, message: Mapping[str, Any]) -> None:
        """``policy``: every group's policy id, version, architecture and weights (arrays, no code)."""
        request_id = field(message, "id", int)
        out = {}
        for g, pid in self._lanes.policy_of.items():
            version, weights = self._service.latest(pid)  # the newest published, even if no act swapped it in
            tensors = {".".join(k) if isinstance(k, tuple) else k: _numpy(v) for k, v in weights.items(True, True)}
            out[g] = {"policy": pid, "version": version, "config": self._policy_config, "tensors": tensors}
        ws.send(encode({"type": "policy", "id": request_id, "groups": out}))

    def _uploaded_versions(self, message: Mapping[str, Any], what: str, request_id: int) -> dict[str, int]:
        """The ``versions`` of a trajectory: group -> a version the server published (0 up to the newest)."""
        versions = field(message, "versions", dict, fatal=False, request=request_id)
        if set(versions) != set(self._codec.groups) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in versions.values()):
            raise ProtocolError("bad_message", f"{what}: 'versions' maps every group {sorted(self._codec.groups)} "
                                               f"to the policy version (int) that acted, got {versions!r}", fatal=False)
        for g, v in versions.items():
            newest, _ = self._service.latest(self._lanes.policy_of[g], weights=False)  # no copy per upload
            if not 0 <= v <= newest:
                raise ProtocolError("spec_violation", f"{what}: group {g!r} acted with version {v}, which the server "
                                                      f"never published (versions 0 to {newest} so far; 'policy' "
                                                      f"answers to get_policy carry theirs)", fatal=False)
        return versions

    def _trajectory(self, ws, message: Mapping[str, Any], episodes: dict[str, Episode]) -> None:
        """Steps a simulator acted itself: recorded like answered ``act`` requests, with the uploaded actions,
        behaviour log-probabilities and policy versions (the learners' staleness rule and importance ratios
        treat them as the off-policy data they may be); answered with ``accepted``."""
        request_id = field(message, "id", int)
        name = name_field(message, "episode", request=request_id)
        what = f"trajectory {request_id} of episode {name!r}"
        try:
            versions = self._uploaded_versions(message, what, request_id)
            steps = field(message, "steps", list, fatal=False, request=request_id)
            episode = episodes.get(name)
            if episode is None and not steps:  # as an end for it would be: nothing to start an episode with
                raise ProtocolError("unknown_episode", f"{what}: no steps, and no such episode is running on this "
                                                       f"connection", fatal=False)
            if episode is None:
                if len(episodes) >= self.config.max_episodes:
                    raise ProtocolError("busy", f"{what}: a connection runs at most {self.config.max_episodes} "
                                                f"episodes at once", fatal=False)
                episode = episodes[name] = Episode(self._lanes, name)
            if episode.waiting:
                raise ProtocolError("bad_message", f"{what}: the episode's last act is not answered yet", fatal=False)
            for i, step in enumerate(steps):
                if not isinstance(step, dict):
                    raise ProtocolError("bad_message", f"{what}: step {i} is not a map", fatal=False)
                request = self._codec.parse_act(step, f"{what} step {i}", acted=True)
                outputs = self._codec.parse_outputs(step, request, f"{what} step {i}")
                episode.consequences(request)
                episode.act(request, outputs, versions)
                with self._lock:  # as each step is taken (kept even if a later one is refused): never fewer
                    self.counters["uploaded_steps"] += 1  # than the steps recorded, whenever they are read
            end = message.get("end")
            if end is not None:
                if not isinstance(end, dict) or end.get("outcome") not in ("terminated", "truncated"):
                    raise ProtocolError("bad_message", f"{what}: 'end' is {{outcome: terminated|truncated, rewards?, "
                                                       f"observations?}}", fatal=False)
                reward, _ = self._codec.consequences(end, f"{what} end")
                final = self._codec.parse_final(end, f"{what} end")
                episodes.pop(name).end(end["outcome"], reward, final)
        except ProtocolError as error:
            error.request, error.episode = request_id, name
            self._episode_error(ws, error, episodes, name)
            return
        ws.send(encode({"type": "accepted", "id": request_id, "episode": name, "steps": len(steps)}))


def _numpy(tensor) -> Any:
    """A CPU tensor as numpy (bfloat16, which numpy lacks, as float32)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()



__all__ = ["LocalPolicyHandlers"]
