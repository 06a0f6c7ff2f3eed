"""Episode statistics and per-agent trajectory views over ``[env, time]`` rollouts (pure functions).

An episode of an env ends after a step whose env-level ``("next", "done")`` is set. Episodes may start in
an earlier fragment: their running sums enter as a *carry* (``[E]`` TensorDict, see :func:`advance_carry`),
so statistics of a stream of fragments equal those of the unbroken stream.

Definitions (group ``g`` with ``A`` agents; lengths count the steps where ``(g, "mask")`` is True, returns
count every reward the env gave the agent, also while it waited for its turn):

- ``length``: env steps of the episode; ``agent_length`` ``[A]``: steps the agent was present;
- ``agent_return`` ``[A, 1]``: sum of the agent's ``("next", g, "reward")`` over the episode;
- ``team_return`` ``[1]``: sum of ``agent_return`` over agents (RLlib's ``episode_reward``);
- ``mean_return``: mean of ``agent_return`` over agents and episodes (seed 001's average episode reward).

Vectorised over envs and episodes (no Python loop over either); running sums are kept in float64.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from core.layout import DONE, ENV_ID, EPISODE_ID, FRAGMENT_ID, MASK, NEXT, POLICY_VERSION, REWARD, WORKER_ID

#: Carry keys: ``(group, RETURN)`` ``[E, A, 1]``, ``(group, LENGTH)`` ``[E, A]``, root ``LENGTH`` ``[E]``.
RETURN = "return"
LENGTH = "length"


def _check(rollout: TensorDict, group: str) -> tuple[int, int, int]:
    if rollout.batch_dims != 2:
        raise ValueError(f"expected an [env, time] rollout, got batch {tuple(rollout.batch_size)}")
    e, t = rollout.batch_size
    reward = rollout.get((NEXT, group, REWARD))
    if reward.dim() != 4 or reward.shape[-1] != 1 or tuple(reward.shape[:2]) != (e, t):
        raise ValueError(f"({NEXT!r}, {group!r}, {REWARD!r}) must be [E, T, A, 1], got {tuple(reward.shape)}")
    done = rollout.get((NEXT, DONE))
    if tuple(done.shape) != (e, t, 1):
        raise ValueError(f"({NEXT!r}, {DONE!r}) must be [E, T, 1], got {tuple(done.shape)}")
    return e, t, reward.shape[2]


def empty_carry(rollout: TensorDict, groups: list[str] | None = None) -> TensorDict:
    """A zero carry ``[E]`` for ``rollout``'s envs (episodes that start with the rollout)."""
    e = rollout.batch_size[0]
    carry = TensorDict({LENGTH: torch.zeros(e, dtype=torch.int64, device=device_of(rollout))}, [e])
    for group in groups if groups is not None else _reward_groups(rollout):
        reward = rollout.get((NEXT, group, REWARD))
        a = reward.shape[2]
        carry.set(group, TensorDict({RETURN: reward.new_zeros(e, a, 1),
                                     LENGTH: torch.zeros(e, a, dtype=torch.int64, device=reward.device)}, [e, a]))
    return carry


def device_of(td: TensorDict) -> torch.device:
    """The TensorDict's device, or its first leaf's when it has none (``device=None`` TensorDicts)."""
    return td.device if td.device is not None else next(iter(td.values(True, True))).device


def _reward_groups(rollout: TensorDict) -> list[str]:
    nxt = rollout.get(NEXT)
    return [k for k, v in nxt.items() if isinstance(v, TensorDict) and REWARD in v.keys()]


def _scan_group(rollout: TensorDict, group: str, carry: TensorDict) -> tuple[TensorDict, TensorDict, torch.Tensor]:
    """Records ``[K]``, group carry ``[E, A]`` and episode-length carry ``[E]`` of one group.

    Per-episode sums are differences of running totals between consecutive episode ends of an env (the
    first end of an env adds the carry); results are cast back to the reward dtype.
    """
    e, t, a = _check(rollout, group)
    done = rollout.get((NEXT, DONE)).reshape(e, t)
    reward = rollout.get((NEXT, group, REWARD))
    mask = rollout.get((group, MASK), None)
    present = torch.ones(e, t, a, dtype=torch.bool, device=reward.device) if mask is None else mask
    if tuple(present.shape) != (e, t, a):
        raise ValueError(f"({group!r}, {MASK!r}) must be [E, T, A] = {(e, t, a)}, got {tuple(present.shape)}")
    e_idx, t_idx = done.nonzero(as_tuple=True)  # row-major: by env, then time
    flat = e_idx * t + t_idx  # 1-D gathers (index_select) are cheaper than 2-D advanced indexing
    same_env = torch.zeros_like(e_idx, dtype=torch.bool)
    same_env[1:] = e_idx[1:] == e_idx[:-1]
    last = torch.zeros(e, dtype=torch.int64, device=done.device).scatter_reduce_(0, e_idx, t_idx + 1, "amax")
    ended = last > 0  # last: [E] 1 + the last end's step, 0 if none
    last_flat = torch.arange(e, device=done.device) * t + (last - 1).clamp(min=0)

    def split(total: torch.Tensor, carried: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Running sums ``[E, T, A]`` -> per completed episode ``[K, A]`` and per open episode ``[E, A]``.
        The carried-in sums ``[E, A]`` join each env's first episode."""
        rows = total.reshape(e * t, a)
        at_end = rows.index_select(0, flat)
        before = torch.zeros_like(at_end)
        before[1:] = at_end[:-1]
        closed = at_end - torch.where(same_env.unsqueeze(-1), before, -carried.index_select(0, e_idx))
        still_open = total[:, -1] - torch.where(ended.unsqueeze(-1), rows.index_select(0, last_flat), -carried)
        return closed, still_open

    # float64 running sums, so a short episode after a large return in the same fragment stays exact
    # Rewards count whether or not the agent acts at that step: a turn-based game pays the waiting loser
    # after the winner's move. Adapters pad the rewards of agents that are not in the env with 0.
    returns = split(torch.nan_to_num(reward.squeeze(-1), nan=0.0).cumsum(1, dtype=torch.float64),
                    carry.get((group, RETURN)).squeeze(-1).double())
    agent_length = split(present.cumsum(1, dtype=torch.int32), carry.get((group, LENGTH)))
    t_before = torch.zeros_like(t_idx)
    t_before[1:] = t_idx[:-1]
    carried_len = carry.get(LENGTH)
    length = torch.where(same_env, t_idx - t_before, t_idx + 1 + carried_len.index_select(0, e_idx))
    open_len = torch.where(ended, t - last, t + carried_len)
    k = e_idx.shape[0]

    def meta(key):
        value = rollout.get(key, None)
        return value.reshape(e * t).index_select(0, flat) if value is not None else \
            torch.full((k,), -1, device=done.device)

    agent_return = returns[0].unsqueeze(-1).to(reward.dtype)
    records = TensorDict(
        {
            ENV_ID: meta(ENV_ID) if ENV_ID in rollout.keys() else e_idx,
            EPISODE_ID: meta(EPISODE_ID),
            WORKER_ID: meta(WORKER_ID),
            FRAGMENT_ID: meta(FRAGMENT_ID),
            POLICY_VERSION: meta((POLICY_VERSION, group)),
            "end_time": t_idx,
            "length": length,
            "agent_length": agent_length[0].long(),
            "agent_return": agent_return,
            "team_return": agent_return.sum(1),
        },
        batch_size=[k],
    )
    group_carry = TensorDict({RETURN: returns[1].unsqueeze(-1).to(reward.dtype), LENGTH: agent_length[1].long()}, [e, a])
    return records, group_carry, open_len


def scan_episodes(
    rollout: TensorDict, carry: TensorDict | None = None, groups: list[str] | None = None
) -> tuple[dict[str, TensorDict], TensorDict]:
    """One pass over ``rollout``: completed-episode records per group and the carry after it.

    Args:
        rollout: ``[E, T]`` rollout with ``("next", group, "reward")`` ``[E, T, A, 1]`` and
            ``("next", "done")`` ``[E, T, 1]``; ``(group, "mask")`` ``[E, T, A]`` honoured when present.
        carry: running sums of the episodes in progress at the rollout's start (the carry returned for
            the previous fragment of the same envs); None when every episode starts with the rollout.
        groups: groups to scan; default every group with a ``("next", group, "reward")``.

    Returns:
        ``(records, carry_out)``. ``records[group]`` is a ``[K]`` TensorDict of the episodes that end
        inside ``rollout``, ordered by env then time: ``ENV_ID``, ``EPISODE_ID``, ``WORKER_ID``,
        ``FRAGMENT_ID`` (-1 where the rollout lacks them), ``POLICY_VERSION`` of the group at the end step
        (-1 if absent), ``"end_time"`` (step index of the end), ``"length"`` ``[K]``, ``"agent_length"``
        ``[K, A]``, ``"agent_return"`` ``[K, A, 1]``, ``"team_return"`` ``[K, 1]``. ``carry_out`` is ``[E]``:
        ``"length"`` ``[E]``, ``(group, "return")`` ``[E, A, 1]``, ``(group, "length")`` ``[E, A]`` of each
        env's episode still open after the last step (zero where the last step ended one).
    """
    groups = groups if groups is not None else _reward_groups(rollout)
    e = rollout.batch_size[0]
    if carry is None:
        carry = empty_carry(rollout, groups)
    records = {}
    out = TensorDict({LENGTH: torch.zeros(e, dtype=torch.int64, device=device_of(rollout))}, [e])
    for group in groups:
        records[group], group_carry, length = _scan_group(rollout, group, carry)
        out.set(group, group_carry)
        out.set(LENGTH, length)
    return records, out


def completed_episodes(rollout: TensorDict, group: str, carry: TensorDict | None = None) -> TensorDict:
    """The ``[K]`` records of :func:`scan_episodes` for one group (episodes ending inside ``rollout``)."""
    return scan_episodes(rollout, carry, [group])[0][group]


def advance_carry(rollout: TensorDict, carry: TensorDict | None = None, groups: list[str] | None = None) -> TensorDict:
    """The ``[E]`` carry after ``rollout`` (see :func:`scan_episodes`), to pass with the next fragment."""
    return scan_episodes(rollout, carry, groups)[1]


def summarize_episodes(records: TensorDict) -> TensorDict:
    """Averages over ``[K]`` records (NaN when ``K == 0``): ``num_episodes``, ``mean_length``,
    ``mean_agent_length`` ``[A]``, ``mean_team_return`` ``[1]``, ``mean_agent_return`` ``[A, 1]``,
    ``mean_return`` (over agents and episodes)."""
    agent_return = records.get("agent_return")
    return TensorDict(
        {
            "num_episodes": torch.tensor(records.batch_size[0]),
            "mean_length": records.get("length").double().mean(),
            "mean_agent_length": records.get("agent_length").double().mean(0),
            "mean_team_return": records.get("team_return").mean(0),
            "mean_agent_return": agent_return.mean(0),
            "mean_return": agent_return.mean(),
        },
        batch_size=[],
    )


def episode_stats(rollout: TensorDict, group: str, carry: TensorDict | None = None) -> TensorDict:
    """:func:`summarize_episodes` of :func:`completed_episodes`, with the records under ``"episodes"`` ``[K]``."""
    records = completed_episodes(rollout, group, carry)
    return summarize_episodes(records).set("episodes", records)


def agent_trajectory(
    rollout: TensorDict, group: str, env: int, agent: int, *, present_only: bool = True
) -> TensorDict:
    """One agent's transitions in one env, traced back to its time steps.

    Args:
        rollout: ``[E, T]`` rollout.
        group, env, agent: which agent (``agent`` indexes the group's agent dim).
        present_only: keep only the steps where ``(group, "mask")`` is True.

    Returns:
        ``[T']`` TensorDict: the group's entries for that agent (``observation``, ``action``, ...), its
        ``"next"`` entries (``reward``, next ``observation``, agent-level flags), ``"time"`` (step index in
        the rollout) and the root metadata present (``EPISODE_ID``, ``ENV_ID``, ``WORKER_ID``,
        ``FRAGMENT_ID``, ``(POLICY_VERSION, group)`` as ``POLICY_VERSION``).
    """
    t = rollout.batch_size[1]
    out = rollout.get(group)[env, :, agent].copy()  # [T]; new container, shared leaves
    nxt = rollout.get((NEXT, group), None)
    if nxt is not None:
        out.set(NEXT, nxt[env, :, agent])
    out.set("time", torch.arange(t, device=device_of(rollout)))
    for key in (EPISODE_ID, ENV_ID, WORKER_ID, FRAGMENT_ID):
        if key in rollout.keys():
            out.set(key, rollout.get(key)[env])
    version = rollout.get((POLICY_VERSION, group), None)
    if version is not None:
        out.set(POLICY_VERSION, version[env])
    if present_only and MASK in out.keys():
        out = out[out.get(MASK)]
    return out
