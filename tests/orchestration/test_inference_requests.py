"""The inference service's request checks (orchestration.inference_requests.make_request): its fast path for
plain requests accepts and refuses exactly what the full checks do (a differential property test)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import orchestration.inference_requests as requests
from core.layout import ACTION_MASK, MASK, OBSERVATION
from core.policies import PolicyConfig, make_policies
from orchestration.envs import make_env

MAX_ROWS = 6


@functools.cache
def _policy():
    env = make_env("builtin:spread", 1)  # 4 agents, 18 features, 5 actions
    policy = make_policies(env.tree, PolicyConfig())["agents"]
    env.close()
    return policy


def _outcome(obs, timeout_s, monkeypatch, fast: bool):
    """``("ok", rows, sorted keys, deadline)`` of a request, or ``(error type, message)``."""
    if not fast:
        monkeypatch.setattr(requests, "_plain_rows", lambda *args: None)  # every request takes the full checks
    try:
        r = requests.make_request("agents", _policy(), obs, None, None, None, max_rows=MAX_ROWS, now=1.0,
                                  timeout_s=timeout_s, deterministic=False)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    finally:
        monkeypatch.undo()
    assert r.inputs is not obs  # its own dict (the caller may reuse its own), the caller's tensors
    assert all(r.inputs[k] is v for k, v in obs.items() if isinstance(v, torch.Tensor))
    return "ok", r.rows, sorted(r.inputs), r.deadline


def _tensor(shape: tuple[int, ...], dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


#: One change that makes a plain request wrong (or no longer plain), or none.
FLAWS = [None, None, "rows 0", "rows over", "agents", "observation dims", "observation tree", "observation list",
         "mask rows", "mask dims", "action_mask rows", "action_mask agents", "action_mask dims", "action_mask list",
         "unknown entry", "no observation", "timeout"]


@st.composite
def plain_requests(draw):
    """``(request, timeout_s)``: a plain request of ``n`` rows, with or without its masks, and at most one
    flaw of ``FLAWS``."""
    n, flaw = draw(st.integers(1, MAX_ROWS)), draw(st.sampled_from(FLAWS))
    rows = {"rows 0": 0, "rows over": MAX_ROWS + 1}.get(flaw, n)
    agents = 3 if flaw == "agents" else 4
    obs = {OBSERVATION: _tensor((rows, agents) if flaw == "observation dims" else (rows, agents, 18), torch.float32)}
    if flaw == "observation tree":
        obs[OBSERVATION] = {"x": obs[OBSERVATION]}
    if flaw == "observation list":
        obs[OBSERVATION] = [0.0] * n
    if draw(st.booleans()) or flaw and flaw.startswith("action_mask"):
        shape = {"action_mask rows": (rows + 1, agents, 5), "action_mask agents": (rows, 2, 5),
                 "action_mask dims": (rows, agents)}.get(flaw, (rows, agents, 5))
        obs[ACTION_MASK] = [True] * 5 if flaw == "action_mask list" else _tensor(shape, torch.bool)
    if draw(st.booleans()) or flaw and flaw.startswith("mask"):
        obs[MASK] = _tensor({"mask rows": (rows + 1, agents), "mask dims": (rows, agents, 1)}.get(flaw, (rows, agents)),
                            torch.bool)
    if flaw == "unknown entry":
        obs["reward"] = _tensor((rows,), torch.float32)
    if flaw == "no observation":
        del obs[OBSERVATION]
    timeout_s = draw(st.sampled_from([-1.0, float("nan"), True, "1"])) if flaw == "timeout" else \
        draw(st.sampled_from([0.5, 0, 3]))
    return obs, timeout_s


@settings(max_examples=300)  # cheap examples; every flaw with and without masks
@given(request=plain_requests())
def test_the_fast_path_accepts_and_refuses_what_the_full_checks_do(request):
    obs, timeout_s = request
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert _outcome(obs, timeout_s, monkeypatch, fast=True) == _outcome(obs, timeout_s, monkeypatch, fast=False)


def test_a_plain_request_takes_the_fast_path(monkeypatch):
    """The property above would hold trivially if the fast path were never taken."""
    taken = []
    plain_rows = requests._plain_rows
    monkeypatch.setattr(requests, "_plain_rows", lambda *args: taken.append(plain_rows(*args)) or taken[-1])
    obs = {OBSERVATION: torch.zeros(2, 4, 18), ACTION_MASK: torch.ones(2, 4, 5, dtype=torch.bool)}
    r = requests.make_request("agents", _policy(), obs, None, None, None, max_rows=MAX_ROWS, now=0.0,
                              timeout_s=1.0, deterministic=True)
    assert taken == [2] and r.rows == 2 and r.deterministic
