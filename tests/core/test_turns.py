"""credit_absent_steps against a plain Python reference loop."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.losses.turns import credit_absent_steps


def _rollout(e, t, a, seed):
    g = torch.Generator().manual_seed(seed)
    present = torch.rand(e, t, a, generator=g) < 0.5
    reward = torch.randn(e, t, a, 1, generator=g)
    term = torch.rand(e, t, a, 1, generator=g) < 0.2
    trunc = torch.rand(e, t, a, 1, generator=g) < 0.1
    env_done = torch.rand(e, t, 1, generator=g) < 0.25
    nxt = TensorDict({"g": TensorDict({"reward": reward, "terminated": term, "truncated": trunc,
                                       "done": term | trunc}, [e, t, a]), "done": env_done}, [e, t])
    return TensorDict({"g": TensorDict({"mask": present}, [e, t, a]), "next": nxt}, [e, t])


def _reference(rollout):
    present = rollout["g", "mask"]
    env_done = rollout["next", "done"].squeeze(-1)
    out = {k: rollout["next", "g", k].clone() for k in ("reward", "terminated", "truncated", "done")}
    e, t, a = present.shape
    for i in range(e):
        for j in range(a):
            last, episode = None, 0
            for s in range(t):
                if present[i, s, j]:
                    last = (s, episode)
                elif last is not None and last[1] == episode:
                    out["reward"][i, last[0], j] += out["reward"][i, s, j]
                    out["reward"][i, s, j] = 0
                    for k in ("terminated", "truncated", "done"):
                        out[k][i, last[0], j] |= out[k][i, s, j]
                        out[k][i, s, j] = False
                episode += int(env_done[i, s])
    return out


@given(e=st.integers(1, 3), t=st.integers(1, 8), a=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_matches_the_reference_loop(e, t, a, seed):
    rollout = _rollout(e, t, a, seed)
    before = rollout["next", "g", "reward"].clone()
    out = credit_absent_steps(rollout, "g")
    expected = _reference(rollout)
    for key, value in expected.items():
        torch.testing.assert_close(out["next", "g", key], value, msg=key)
    torch.testing.assert_close(rollout["next", "g", "reward"], before)  # the input is untouched


def test_connect_four_loser_gets_its_penalty_on_its_last_move():
    # two players alternate; player 1 moved at t=0, player 0 wins at t=1 and player 1 gets -1 while absent.
    present = torch.tensor([[[False, True], [True, False]]])
    reward = torch.tensor([[[0.0, 0.0], [1.0, -1.0]]]).unsqueeze(-1)
    term = torch.tensor([[[False, False], [True, True]]]).unsqueeze(-1)
    nxt = TensorDict({"g": TensorDict({"reward": reward, "terminated": term, "done": term}, [1, 2, 2]),
                      "done": torch.tensor([[[False], [True]]])}, [1, 2])
    out = credit_absent_steps(TensorDict({"g": TensorDict({"mask": present}, [1, 2, 2]), "next": nxt}, [1, 2]), "g")
    assert out["next", "g", "reward"][0, 0, 1].item() == -1.0 and out["next", "g", "terminated"][0, 0, 1].item()
    assert out["next", "g", "reward"][0, 1, 0].item() == 1.0 and out["next", "g", "reward"][0, 1, 1].item() == 0.0
