"""Credit for agents that are absent when their consequences arrive (turn-based games, agents that left).

In a turn-based (AEC) game an agent acts at its own steps only (``mask`` True) but its reward may arrive at a
step where another agent acts: connect-four's loser gets -1 right after the winner's move. The estimators
ignore absent steps, so that reward would be lost. :func:`credit_absent_steps` moves every reward and
terminal flag that lands on an absent step of an agent back onto the agent's most recent present step of
the same episode, where its last action is, before GAE/V-trace run.

Shapes: root ``[E, T]``; ``(group, "mask")`` ``[E, T, A]``; ``("next", group, "reward"|"terminated"|"done"|
"truncated")`` ``[E, T, A, 1]``; ``"episode_id"`` ``[E, T]`` (optional: without it, ``("next", "done")`` at
env level delimits episodes). A reward that arrives before the agent's first present step in the fragment
stays where it is (its action lies in an earlier fragment) and is ignored by the estimators, as before.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from core.layout import DONE, EPISODE_ID, MASK, NEXT, REWARD, TERMINATED, TRUNCATED


def _episode_index(rollout: TensorDictBase) -> torch.Tensor:
    """``[E, T]`` int64 episode index: the stored ids, or a running count of env-level dones."""
    if EPISODE_ID in rollout.keys():
        return rollout.get(EPISODE_ID)
    done = rollout.get((NEXT, DONE)).squeeze(-1).long()
    return done.cumsum(1) - done


def credit_absent_steps(rollout: TensorDictBase, group: str) -> TensorDictBase:
    """A shallow copy of ``rollout`` whose ``group`` rewards and end flags sit on present steps only.

    For every env and agent, the reward (summed) and the ``terminated``/``truncated``/``done`` flags (or-ed) of
    each absent step move to the latest earlier present step of the same episode; absent steps keep reward 0
    and no flags. Steps with no such present step are left unchanged. Vectorised: one ``cummax`` and one
    ``scatter_add`` along time, no Python loop over envs, steps or agents.
    """
    g_next = rollout.get((NEXT, group))
    present = rollout.get((group, MASK))  # [E, T, A]
    if bool(present.all()):  # nobody is ever absent (most envs): nothing to move, skip the scans
        return rollout
    e, t, a = present.shape
    steps = torch.arange(t, device=present.device).view(1, t, 1).expand(e, t, a)
    last = torch.where(present, steps, torch.full_like(steps, -1)).cummax(1).values  # latest present step <= t
    episode = _episode_index(rollout).unsqueeze(-1).expand(e, t, a)
    safe_last = last.clamp(min=0)
    same_episode = (last >= 0) & (episode.gather(1, safe_last) == episode)
    move = ~present & same_episode  # [E, T, A]: absent steps whose consequences go back to `last`
    if not bool(move.any()):
        return rollout
    out_next = g_next.copy()
    reward = g_next.get(REWARD)
    moved = torch.where(move.unsqueeze(-1), reward, torch.zeros_like(reward))
    credited = torch.where(move.unsqueeze(-1), torch.zeros_like(reward), reward)
    out_next.set(REWARD, credited.scatter_add(1, safe_last.unsqueeze(-1), moved))
    for flag in (TERMINATED, TRUNCATED, DONE):
        if flag in g_next.keys():
            value = g_next.get(flag)
            carried = (value & move.unsqueeze(-1)).to(torch.int64)
            gathered = torch.zeros_like(carried).scatter_add(1, safe_last.unsqueeze(-1), carried) > 0
            out_next.set(flag, (value & ~move.unsqueeze(-1)) | gathered)
    out = rollout.copy()
    nxt = rollout.get(NEXT).copy()
    nxt.set(group, out_next)
    out.set(NEXT, nxt)
    return out


__all__ = ["credit_absent_steps"]
