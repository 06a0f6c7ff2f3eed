"""``shoal export``: one ``torch.export`` program per policy of a checkpoint, and a manifest documenting them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import tyro

from orchestration.checkpoint import load_checkpoint
from orchestration.result_line import print_result
from orchestration.run_state import load_config, load_policy_weights_


def export(checkpoint: tyro.conf.Positional[str], out: str = "exported") -> list[str]:
    """Writes one ``torch.export`` program per policy of the checkpoint (eval-only observations removed) plus
    ``manifest.json``; returns the program paths.

    Every policy id of the checkpoint (``state["learners"]`` and the ``"<pid>/"`` prefixes of the weights) is
    exported with its own weights: group policies, policies of ``policy_mapping`` that are not group names
    (built like the trainer builds them: the architecture of the first group they act in), and fixed ones
    (``"fixed": true`` in the manifest: ``random`` and ``fixed_policies``). A program gives the deterministic
    action, so ``random``'s program returns its mode, the first legal action, not a uniform sample. A policy
    acting in several groups gets one program per group (``<pid>.pt2`` for its first, ``<pid>@<group>.pt2``
    for the others).

    ``manifest.json`` holds ``tree`` (the deployment view), ``agents`` (agent -> ``policy``, ``file``,
    ``group``, ``slot``), ``policies`` (pid -> ``file``, ``files`` per group, ``agents``, ``fixed``,
    ``version``, ``observation_keys``/``action_keys`` as leaf paths: ``"observation"`` for a bare leaf,
    ``"observation/<key path>"`` otherwise, ``recurrent``) and ``programs`` (file -> ``policy``, ``group``,
    ``capacity``, ``agents`` (agent -> slot it acts for), ``inputs``/``outputs``/``returns`` from
    :func:`core.policies.export.deployment_signature`). A program computes every slot of its group's agent
    dim ``[batch, capacity, ...]``; an agent's action is the row at its slot in its policy's program.
    """
    from core.policies import export_policy
    from core.policies.export import deployment_signature, leaf_name
    from core.specs import deployment_view, from_json, groups, rand, to_json
    from orchestration.builder import assignment_for, is_fixed

    weights, _, state = load_checkpoint(checkpoint)
    config, tree = load_config(state), from_json(state["tree"])
    assignment = assignment_for(config, tree)
    group_specs = groups(tree)
    policies = _export_policies(weights, config, tree, assignment)
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, no permission
        raise ValueError(f"--out {out}: cannot make that directory ({error.strerror or error})") from None
    manifest: dict = {"format": "shoal.export/2", "tree": to_json(deployment_view(tree)), "layout": _EXPORT_LAYOUT,
                      "agents": {}, "policies": {}, "programs": {}}
    written: list[str] = []
    example = rand(tree, (2,), torch.Generator().manual_seed(0))
    for pid, policy in policies.items():
        files, agents = {}, []
        acting = {g: a.slots[pid] for g, a in assignment.items() if pid in a.policies}
        for i, (group, slots) in enumerate(acting.items()):
            stem = _file_stem(pid) + ("" if i == 0 else f"@{_file_stem(group)}")
            name, k = f"{stem}.pt2", 1
            while name in manifest["programs"]:  # two ids that differ only in characters a file name cannot hold
                name, k = f"{stem}-{k}.pt2", k + 1
            try:
                program = export_policy(policy, example.get(group))
                signature = deployment_signature(policy, example.get(group))
            except Exception as err:
                raise ValueError(f"policy {pid!r} cannot be exported for group {group!r}: {err}") from err
            path = out_dir / name
            torch.export.save(program, str(path))
            written.append(str(path))
            spec = group_specs[group]
            slot_of = {agent: slot for slot, agent in enumerate(spec.agent_names) if bool(slots[slot])}
            manifest["programs"][name] = {"policy": pid, "group": group, "capacity": spec.capacity,
                                          "agents": slot_of, **signature}
            for agent, slot in slot_of.items():
                manifest["agents"][agent] = {"policy": pid, "file": name, "group": group, "slot": slot}
            files[group], agents = name, agents + list(slot_of)
        manifest["policies"][pid] = {
            "file": next(iter(files.values())), "files": files, "agents": agents,
            "fixed": is_fixed(config, pid),
            "version": state.get("learners", {}).get(pid, {}).get("version"),
            "observation_keys": [leaf_name("observation", k) for k in policy.actor_encoder.paths],
            "action_keys": [leaf_name("action", k) for k in policy.heads.paths],
            "recurrent": policy.recurrent,
        }
    order = [a for spec in group_specs.values() for a in spec.agent_names]
    manifest["agents"] = {a: manifest["agents"][a] for a in order if a in manifest["agents"]}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print_result({"exported": written, "manifest": str(out_dir / "manifest.json")})
    return written


_EXPORT_LAYOUT = (
    "program(*observation, action_mask=..., recurrent_state=...) -> action (or a tuple, see 'returns'). "
    "Every tensor is [batch, capacity, ...]: batch is free, capacity is the program's group size and every "
    "slot is computed; an agent's action is the row at its slot (agents[name]: file, slot). Inputs are listed "
    "per program with name, kind (positional/keyword), dtype and shape; observation leaves are positional in "
    "the listed order, action_mask [batch, capacity, n] bool is required when listed (all True allows every "
    "action); a keyword input's 'path' is its place inside the argument 'keyword' (a structured action's masks "
    "are one nested dict: action_mask={key: tensor or dict, ...}). Outputs are deterministic actions: argmax "
    "of legal logits, Gaussian mean, logit > 0."
)


def _file_stem(name: str) -> str:
    """A policy or group name made safe as a file name (nested group names hold ``/``)."""
    return "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)


def _export_policies(weights, config, tree, assignment) -> dict:
    """Policy id -> module with the checkpoint's weights, for every policy of the run (the one builder's ids
    and architectures: a policy id that is not a group name has the architecture of its first group)."""
    from orchestration.builder import build_policies

    policies, _ = build_policies(config, tree, assignment)
    for pid, policy in policies.items():
        load_policy_weights_(policy, weights, pid)
        policy.eval()
    return policies


__all__ = ["export"]
