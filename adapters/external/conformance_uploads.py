"""The conformance kit's side of local policies (docs/external-protocol.md, "Local policies"): it answers
``get_policy`` with a freshly initialised policy of the simulator's tree (version 0, the default
``PolicyConfig``, as a server of a run with defaults would), and checks ``trajectory`` uploads by the server's
own parser: the step bodies, each acting agent's ``action`` (in its space, legal under the mask) and finite
``log_prob``, ``versions`` (only version 0 was published), and ``end``."""

from __future__ import annotations

import dataclasses
from typing import Any

from adapters.external.conformance_checks import Checked, EpisodeState, KitTree, membership
from adapters.external.messages import ProtocolError


def policy_message(tree: KitTree, request_id: Any) -> dict[str, Any]:
    """The ``policy`` answer: per group, its policy id (the group's name), version 0, architecture and weights."""
    from core.policies import PolicyConfig, make_policies

    config = PolicyConfig()
    policies = make_policies(tree.codec.tree, config)
    groups = {}
    for g, policy in policies.items():
        tensors = {name: p.detach().numpy() for name, p in policy.state_dict().items()}
        groups[g] = {"policy": g, "version": 0, "config": dataclasses.asdict(config), "tensors": tensors}
    return {"type": "policy", "id": request_id, "groups": groups}


def check_trajectory(message: dict[str, Any], tree: KitTree, what: str, episode: EpisodeState,
                     ) -> tuple[Checked, int, int]:
    """A ``trajectory``'s versions, steps and optional ``end``: ``(findings, steps accepted, agents that joined
    mid-episode)``; ``episode``: what earlier uploads of the episode showed (updated: agents seen and gone, as
    acts update it). A finding from the server's parser keeps its ``fatal`` (:meth:`Checked.fail`); steps after
    the first bad one are not read."""
    out, codec = Checked(), tree.codec
    versions = message.get("versions")
    if not isinstance(versions, dict) or set(versions) != set(codec.groups):
        out.fail("trajectory.versions", f"{what}: 'versions' maps every group {sorted(codec.groups)} to the policy "
                                        f"version that acted, got {versions!r}")
    elif any(v != 0 for v in versions.values()):
        out.fail("trajectory.versions", f"{what}: versions {versions!r}, but the kit published version 0 only "
                                        f"(a server refuses a version it never published)")
    if out.failures:  # the server refuses the whole message: no step of it is kept
        return out, 0, 0
    steps = message.get("steps")
    if not isinstance(steps, list):
        out.fail("trajectory.steps", f"{what}: 'steps' must be a list of step maps, got {type(steps).__name__}")
        return out, 0, 0
    done = joined = 0
    try:
        for i, step in enumerate(steps):
            if not isinstance(step, dict):
                raise ProtocolError("bad_message", f"{what}: step {i} is not a map", fatal=False)
            request = codec.parse_act(step, f"{what} step {i}", acted=True)
            codec.parse_outputs(step, request, f"{what} step {i}")
            codec.consequences(step, f"{what} step {i}")
            agents, left = step.get("agents") or {}, step.get("left") or {}
            problems, gone = membership(agents, left if isinstance(left, dict) else {}, tree, episode, "trajectory")
            if problems:
                raise ProtocolError("spec_violation", f"{what} step {i}: {problems[0][1]}", fatal=False)
            joined += len(set(agents) - episode.seen) if episode.acts else 0
            out.left |= gone
            episode.seen |= set(agents)
            episode.gone |= gone
            episode.acts += 1
            done += 1
        end = message.get("end")
        if end is not None:
            if not isinstance(end, dict) or end.get("outcome") not in ("terminated", "truncated"):
                raise ProtocolError("bad_message", f"{what}: 'end' is {{outcome: terminated|truncated, rewards?, "
                                                   f"observations?}}", fatal=False)
            out.covered.add(end["outcome"])
            codec.consequences(end, f"{what} end")
            codec.parse_final(end, f"{what} end")
    except ProtocolError as error:
        out.fail("trajectory.step", error)
    out.covered.add("local_policy")
    return out, done, joined


__all__ = ["check_trajectory", "policy_message"]
