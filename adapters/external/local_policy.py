"""A simulator or robot that acts with its own copy of the run's policies (docs/external-protocol.md, "Local
policies"): no network round trip per action. It fetches the policies' architecture and weights (arrays, no
code), acts with them here, and uploads what happened (observations, actions, behaviour log-probabilities,
rewards, the policy version) in ``trajectory`` messages; the learners treat that data as the off-policy data
it may be (staleness rule, importance ratios of the recorded log-probabilities).

Usage (the same calls as :class:`adapters.external.client.SimulatorClient`)::

    client = SimulatorClient(url, token, tree_document, "robot-1")
    policy = LocalPolicy(client, tree_document, seed=0)
    actions = policy.act("ep-1", {"agents_0": obs}, rewards=rewards).actions   # computed here
    policy.end("ep-1", "terminated", rewards=rewards)                          # uploads the episode's rest
    policy.refresh()                                                           # newer weights (uploads first)

Needs torch and Shoal's core (the networks are built from the tree exactly as the learner builds them).
Recurrent policies are not supported here yet.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
import torch
from tensordict import TensorDict

from adapters.external.client import Answer, SimulatorClient
from adapters.external.codec import TreeCodec, action_value
from core.layout import ACTION, ACTION_MASK, LOG_PROB, MASK, OBSERVATION
from core.policies import make_policies
from core.policies.config import policy_config_from_dict
from core.specs import from_json


class LocalPolicy:
    """Acts with local copies of the run's policies and uploads the steps (module docstring).

    Args:
        client: a connected client.
        tree: the tree document this simulator sent in its hello.
        seed: seeds the sampling generator.
        upload_every: steps of one episode kept before they are uploaded (an episode's end uploads the rest).
        threads: torch threads of this process (``torch.set_num_threads``): a policy acting on one row at a time
            is fastest on one, and several simulators on one machine each taking every core slow each other
            down; None leaves torch's setting alone.
    """

    def __init__(self, client: SimulatorClient, tree: Mapping[str, Any], *, seed: int = 0,
                 upload_every: int = 64, threads: int | None = 1) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.client, self.upload_every = client, upload_every
        self.codec = TreeCodec(from_json(json.dumps(dict(tree))))
        self.generator = torch.Generator().manual_seed(seed)
        self.policies: dict[str, Any] = {}
        self.versions: dict[str, int] = {}
        self._pending: dict[str, list[dict]] = {}
        self.refresh()

    def refresh(self) -> dict[str, int]:
        """Uploads every pending step (they were acted with the current weights), then loads the newest
        policies; returns the versions now acting."""
        for episode in list(self._pending):
            self._upload(episode)
        for group, entry in self.client.get_policy().items():
            module = make_policies(self.codec.tree, policy_config_from_dict(entry["config"]))[group]
            if module.recurrent:
                raise ValueError(f"group {group!r}: a recurrent policy cannot act locally yet; use act requests")
            params = TensorDict.from_module(module)
            tensors = {tuple(k.split(".")): torch.from_numpy(np.ascontiguousarray(v)) for k, v in
                       entry["tensors"].items()}
            missing = set(params.keys(True, True)) ^ set(tensors)
            if missing:
                raise ValueError(f"group {group!r}: the server's weights do not fit the policy built here "
                                 f"(entries {sorted('.'.join(k) for k in missing)[:4]})")
            with torch.no_grad():
                params.update_({k: v.to(params[k].dtype) for k, v in tensors.items()})
            self.policies[group] = module.eval()
            self.versions[group] = int(entry["version"])
        return dict(self.versions)

    def act(self, episode: str, agents: Mapping[str, Any], *, rewards: Mapping[str, float] | None = None,
            left: Mapping[str, str] | None = None, shared: Any = None,
            action_masks: Mapping[str, np.ndarray] | None = None) -> Answer:
        """Actions for ``agents`` (agent -> observation), chosen here; the step is kept for upload."""
        step: dict[str, Any] = {"agents": {}}
        for name, obs in agents.items():
            entry = {"observation": _arrays(obs)}
            if action_masks and name in action_masks:
                entry["action_mask"] = np.asarray(action_masks[name], dtype=bool)
            step["agents"][name] = entry
        if rewards:
            step["rewards"] = {k: float(v) for k, v in rewards.items()}
        if left:
            step["left"] = dict(left)
        if shared is not None:
            step["shared"] = _arrays(shared)
        request = self.codec.parse_act(step, f"episode {episode!r}")
        actions = {}
        with torch.no_grad():
            for group, module in self.policies.items():
                if not bool(request.mask[group].any()):
                    continue
                inputs = {OBSERVATION: request.observation[group], MASK: request.mask[group]}
                if group in request.action_mask:
                    inputs[ACTION_MASK] = request.action_mask[group]
                out = module.act_step(inputs, request.shared, self.generator, False, with_value=False,
                                      with_log_prob=True)
                for name, g, slot in request.agents:
                    if g == group:
                        actions[name] = action_value(out[ACTION], slot)
                        step["agents"][name]["action"] = actions[name]
                        step["agents"][name]["log_prob"] = float(out[LOG_PROB][0, slot, 0])
        pending = self._pending.setdefault(episode, [])
        pending.append(step)
        if len(pending) >= self.upload_every:
            self._upload(episode)
        return Answer(actions, min(self.versions.values()), episode, -1)

    def end(self, episode: str, outcome: str, *, rewards: Mapping[str, float] | None = None,
            observations: Mapping[str, Any] | None = None) -> None:
        """Ends ``episode`` and uploads what is left of it."""
        end: dict[str, Any] = {"outcome": outcome}
        if rewards:
            end["rewards"] = {k: float(v) for k, v in rewards.items()}
        if observations:
            end["observations"] = {k: _arrays(v) for k, v in observations.items()}
        self._upload(episode, end)

    def _upload(self, episode: str, end: Mapping[str, Any] | None = None) -> None:
        steps = self._pending.pop(episode, [])
        if steps or end is not None:
            self.client.upload(episode, self.versions, steps, end=end)


def _arrays(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _arrays(v) for k, v in value.items()}
    return np.asarray(value)


__all__ = ["LocalPolicy"]
