"""Completed-episode records of a fragment builder, as per-policy and per-agent return arrays (every actor's)."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from tensordict import TensorDictBase

from orchestration.assignment import GroupAssignment


def episode_records(records: Mapping[str, TensorDictBase],
                    assignment: Mapping[str, GroupAssignment]) -> dict[str, np.ndarray]:
    """Completed-episode records (``FragmentBuilder.pop_completed_episodes``) as float64 ``[K]`` arrays each,
    in env-then-time order.

    ``"return"``: the sum of every agent's return (the usual score of a single-agent or cooperative env);
    ``"return/<policy>"``: the summed return of the agents that policy acts for; ``"length"``;
    ``"agents/<group>"`` ``[K, A]``: every agent's own return. ``{}`` when nothing was recorded.
    """
    if not records:
        return {}
    per_policy: dict[str, torch.Tensor] = {}
    agents = {}
    for group, r in records.items():
        agent_return = r.get("agent_return").squeeze(-1).cpu()  # [K, A] (an actor on CUDA records there)
        agents[f"agents/{group}"] = agent_return.double().numpy()
        for pid, slots in assignment[group].slots.items():
            part = (agent_return * slots).sum(-1)
            per_policy[pid] = per_policy[pid] + part if pid in per_policy else part
    out = {f"return/{pid}": v.double().numpy() for pid, v in per_policy.items()}
    out["return"] = torch.stack(list(per_policy.values())).sum(0).double().numpy()
    out["length"] = next(iter(records.values())).get("length").reshape(-1).double().cpu().numpy()
    return {**out, **agents}


__all__ = ["episode_records"]
