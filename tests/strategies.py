"""Shared hypothesis strategies with tiny shapes (STYLE.md convention 9, snippet 8)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import (
    DONE, EPISODE_ID, MASK, NEXT, OBSERVATION, POLICY_VERSION, REWARD, TERMINATED, TRUNCATED,
)

GROUP = "agents"


def _bools(draw, n: int, p_true_one_in: int = 2) -> list[bool]:
    """``n`` booleans, True with probability about ``1 / p_true_one_in`` (shrinks towards False)."""
    return draw(st.lists(st.integers(0, p_true_one_in - 1), min_size=n, max_size=n).map(
        lambda xs: [x == p_true_one_in - 1 for x in xs]))


@st.composite
def rollouts(draw, max_envs: int = 4, max_steps: int = 6, max_agents: int = 3, max_version: int = 5) -> TensorDict:
    """A ``[env, time]`` rollout of one group ``"agents"``.

    ``(GROUP, "uid")`` ``[E, T, A, 1]`` numbers every (env, step, agent) once, in env-time-agent order;
    ``(GROUP, "mask")`` is drawn; ``(POLICY_VERSION, GROUP)`` is constant along time per env (as in fragments);
    ``("next", GROUP, "reward")`` equals the uid (as float) so sums are checkable.
    """
    e, t, a = (draw(st.integers(1, m), label=name) for m, name in
               ((max_envs, "envs"), (max_steps, "steps"), (max_agents, "agents")))
    uid = torch.arange(e * t * a).reshape(e, t, a, 1)
    mask = torch.tensor(_bools(draw, e * t * a, 3)).reshape(e, t, a).logical_not()  # mostly present
    versions = torch.tensor(draw(st.lists(st.integers(0, max_version), min_size=e, max_size=e)))
    group = TensorDict({"uid": uid, OBSERVATION: uid.float().expand(e, t, a, 3).clone(), MASK: mask}, [e, t, a])
    nxt = TensorDict({GROUP: TensorDict({REWARD: uid.float()}, [e, t, a]),
                      DONE: torch.zeros(e, t, 1, dtype=torch.bool)}, [e, t])
    return TensorDict({GROUP: group, NEXT: nxt,
                       POLICY_VERSION: {GROUP: versions.unsqueeze(1).expand(e, t).clone()},
                       EPISODE_ID: torch.arange(e).unsqueeze(1).expand(e, t).clone()}, [e, t])


@dataclass
class StepStream:
    """A simulated vectorised env run, as the per-step dicts an actor would hand to ``FragmentBuilder``.

    Ground truth (nested lists indexed ``[env][step]`` / ``[env][step][agent]``) sits beside the steps.
    Observations are unique ids: ``obs[e][t]`` is the id before step t, ``final[e][t]`` the id after it
    (the final observation when ``done[e][t]``); after a done the env resets to a fresh id.
    """

    num_envs: int
    num_agents: int
    fragment_length: int
    num_fragments: int
    steps: list[dict] = field(repr=False)
    obs: list[list[int]]
    final: list[list[int]]
    done: list[list[bool]]
    truncated: list[list[bool]]
    mask: list[list[list[bool]]]
    reward: list[list[list[int]]]


@st.composite
def step_streams(draw, max_envs: int = 3, max_agents: int = 3, max_fragments: int = 4, max_length: int = 5) -> StepStream:
    """Random episode ends (about one step in three), truncations, masks (3/4 present), integer rewards."""
    e = draw(st.integers(1, max_envs), label="envs")
    a = draw(st.integers(1, max_agents), label="agents")
    length = draw(st.integers(1, max_length), label="fragment_length")
    frags = draw(st.integers(1, max_fragments), label="fragments")
    n = length * frags
    done = torch.tensor(_bools(draw, e * n, 3)).reshape(e, n)
    truncated = done & torch.tensor(_bools(draw, e * n, 2)).reshape(e, n)
    # masks and rewards from a drawn seed (cheap to generate); the episode structure (dones) is drawn
    # element-wise so that it shrinks towards fewer episode ends
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))
    mask = torch.rand(e, n, a, generator=g) >= 0.25
    reward = torch.randint(-3, 4, (e, n, a), generator=g)

    counter = e
    cur = list(range(e))
    obs, final = [[0] * n for _ in range(e)], [[0] * n for _ in range(e)]
    steps = []
    for t in range(n):
        nxt_ids = []
        for env in range(e):
            obs[env][t] = cur[env]
            final[env][t] = counter
            nxt_ids.append(counter)
            counter += 1
            if done[env, t]:
                cur[env], counter = counter, counter + 1  # reset observation: a fresh id
            else:
                cur[env] = final[env][t]
        ids_now = torch.tensor([obs[env][t] for env in range(e)], dtype=torch.float32)
        ids_next = torch.tensor(nxt_ids, dtype=torch.float32)
        agent_ix = torch.arange(a, dtype=torch.float32).expand(e, a)
        d, tr = done[:, t].reshape(e, 1), truncated[:, t].reshape(e, 1)
        flags = {TERMINATED: d & ~tr, TRUNCATED: tr, DONE: d}
        steps.append({
            GROUP: {OBSERVATION: torch.stack([ids_now.unsqueeze(1).expand(e, a), agent_ix], -1),
                    MASK: mask[:, t].clone(), "recurrent_state": ids_now.reshape(e, 1, 1).expand(e, a, 2).clone()},
            NEXT: {GROUP: {OBSERVATION: torch.stack([ids_next.unsqueeze(1).expand(e, a), agent_ix], -1),
                           REWARD: reward[:, t].float().unsqueeze(-1),
                           **{k: v.unsqueeze(1).expand(e, a, 1).clone() for k, v in flags.items()}},
                   **{k: v.clone() for k, v in flags.items()}},
        })
    return StepStream(e, a, length, frags, steps, obs, final, done.tolist(), truncated.tolist(),
                      mask.tolist(), reward.tolist())


def episodes_by_hand(stream: StepStream) -> dict[int, dict]:
    """Plain-Python recount of completed episodes, keyed by episode id (``env + E * k``)."""
    out = {}
    for env in range(stream.num_envs):
        k, length = 0, 0
        ret, alen = [0] * stream.num_agents, [0] * stream.num_agents
        for t in range(len(stream.done[env])):
            length += 1
            for agent in range(stream.num_agents):
                ret[agent] += stream.reward[env][t][agent]  # rewards count while waiting, too
                if stream.mask[env][t][agent]:
                    alen[agent] += 1
            if stream.done[env][t]:
                out[env + stream.num_envs * k] = {"env": env, "length": length, "agent_return": list(ret),
                                                  "agent_length": list(alen)}
                k, length = k + 1, 0
                ret, alen = [0] * stream.num_agents, [0] * stream.num_agents
    return out
