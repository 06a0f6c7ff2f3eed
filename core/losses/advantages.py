"""GAE and V-trace in Shoal's layout, with agent masks, on top of TorchRL's functional kernels.

Tensors are ``[env, time, agent, 1]`` (time is dim 1; any number of dims may sit between time and the
trailing 1, and ``[env, time, 1]`` works too). ``done`` cuts a trajectory; ``terminated`` also stops
bootstrapping, so a truncation (``done & ~terminated``) is cut *and* bootstrapped from the next value.

Masks (absent agents). An agent step with ``mask == False`` does not exist: its inputs are replaced by
zeros (padding may hold anything, NaN included) and it is made a trajectory boundary. A present step whose
*next* step (same env, same agent slot) is absent is cut there too, and bootstraps from its own
``("next", group, "state_value")`` unless it is ``terminated``: an agent that leaves without a terminal
flag is treated as truncated, and one that joins later starts a new trajectory. Hence the advantage and
value target are exactly 0 at absent steps and nothing flows across an absence in either direction.

TorchRL's kernels are imported on first use: ``torchrl`` imports ``torch._dynamo``, which a process that only
samples (a rollout worker importing the learner's modules) need not pay for (``benchmarks/worker_start.py``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from core.layout import (ADVANTAGE, DONE, LOG_PROB, MASK, NEXT, REWARD, STATE_VALUE, TERMINATED, VALUE_TARGET,
                         group_of)

_TIME_DIM = 1


def gae(
    state_value: torch.Tensor,
    next_state_value: torch.Tensor,
    reward: torch.Tensor,
    done: torch.Tensor,
    terminated: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    lmbda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438), computed without grad.

    ``delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t)`` and
    ``A_t = delta_t + gamma * lmbda * (1 - done_t) * A_{t+1}``; ``value_target = A + V``.

    Args:
        state_value: ``V(s_t)``, ``[E, T, A, 1]`` float.
        next_state_value: ``V(s_{t+1})`` of the observation that followed step t, same shape.
        reward: ``r_t``, same shape.
        done: bool, same shape: trajectory boundary after step t.
        terminated: bool, same shape: true end after step t (no bootstrap).
        mask: bool ``[E, T, A]`` (shape without the trailing 1), True where the agent is present; None: all.
        gamma: discount.
        lmbda: GAE lambda.

    Returns:
        ``(advantage, value_target)``, both ``[E, T, A, 1]``, exactly 0 where ``mask`` is False.

    Raises:
        ValueError: on a shape or dtype that does not match ``state_value``, or a gamma or lambda outside [0, 1].
    """
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    for name, value in (("gamma", gamma), ("lmbda", lmbda)):
        if not 0.0 <= value <= 1.0:  # 1.5 made returns grow without bound, in silence
            raise ValueError(f"gae: {name} must be in [0, 1], got {value!r}")
    _checked(state_value, next_state_value, reward, done, terminated, mask)
    inputs = (state_value, next_state_value, reward, done, terminated, mask)
    envs, per_env = state_value.shape[0], max(1, state_value.shape[1:].numel())
    rows = max(1, GAE_CHUNK // per_env, -(-envs // GAE_CALLS))  # env rows per call
    with torch.no_grad():
        if envs <= rows:
            return _gae_rows(generalized_advantage_estimate, gamma, lmbda, *inputs)
        # Envs are independent: a large batch is estimated a chunk of envs at a time, so that the estimator's
        # float temporaries (about 8 per entry) stay bounded by the chunk instead of doubling a large batch.
        advantage = value_target = None
        for i in range(0, envs, rows):
            a, v = _gae_rows(generalized_advantage_estimate, gamma, lmbda,
                             *(None if x is None else x[i:i + rows] for x in inputs))
            if advantage is None:  # the estimator's dtype (promoted over its inputs), as for a whole batch
                advantage, value_target = a.new_empty(state_value.shape), v.new_empty(state_value.shape)
            advantage[i:i + rows], value_target[i:i + rows] = a, v
        return advantage, value_target


#: Entries (``T * A`` per env) :func:`gae` estimates in one call at least; a larger batch goes a chunk of envs
#: at a time, in at most :data:`GAE_CALLS` calls (``benchmarks/transition_memory.py``: at 16,384 CartPoles x 64
#: steps the whole-batch call added 32 bytes of temporaries per transition to the 98 a transition holds). Not
#: smaller chunks: torchrl's estimator loops over time in Python, so each call costs ``T`` loop steps.
GAE_CHUNK = 1 << 15
#: Calls :func:`gae` splits a batch of more than :data:`GAE_CHUNK` entries into (temporaries: 1/8 of the batch).
GAE_CALLS = 8


def _gae_rows(estimator, gamma, lmbda, state_value, next_state_value, reward, done, terminated, mask):
    """torchrl's GAE on ``[e, T, ..., 1]`` inputs already checked (absent steps zeroed and cut first)."""
    sv, nsv, r, d, term = _prepared(state_value, next_state_value, reward, done, terminated, mask, check=False)
    # The exact backward loop: faster than the vectorised kernel for fragments up to a few hundred steps
    # (1.9 vs 4.3 ms at [64, 128, 3, 1]) and free of its 1e-7 truncation of the discount series.
    return estimator(gamma, lmbda, sv, nsv, r, d, term, time_dim=_TIME_DIM)


def vtrace(
    target_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    state_value: torch.Tensor,
    next_state_value: torch.Tensor,
    reward: torch.Tensor,
    done: torch.Tensor,
    terminated: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float,
    rho_thresh: float = 1.0,
    c_thresh: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets and advantages (Espeholt et al. 2018, IMPALA, arXiv:1802.01561), computed without grad.

    With ``rho_t = min(rho_thresh, pi(a_t|s_t) / mu(a_t|s_t))`` and ``c_t = min(c_thresh, pi / mu)``:
    ``v_s - V(s_t) = rho_t delta_t + gamma (1 - done_t) c_t (v_{s+1} - V(s_{t+1}))`` with
    ``delta_t = r_t + gamma (1 - terminated_t) V(s_{t+1}) - V(s_t)``; the policy-gradient advantage is
    ``rho_t (r_t + gamma (1 - terminated_t) v_{t+1} - V(s_t))`` where ``v_{t+1}`` is the next value
    ``V(s_{t+1})`` at a boundary. Returns ``(advantage, value_target = v_s)``.

    Args:
        target_log_prob: ``log pi(a_t|s_t)`` of the policy being trained, ``[E, T, A, 1]``.
        behaviour_log_prob: ``log mu(a_t|s_t)`` recorded when acting, same shape.
        state_value: ``V(s_t)``, same shape.
        next_state_value: ``V(s_{t+1})``, same shape.
        reward: ``r_t``, same shape.
        done: bool, same shape.
        terminated: bool, same shape.
        mask: bool ``[E, T, A]``, True where the agent is present; None: all.
        gamma: discount.
        rho_thresh: truncation ``rho_bar`` of the importance weight in the TD error.
        c_thresh: truncation ``c_bar`` of the trace-cutting weights.

    Returns:
        ``(advantage, value_target)``, both ``[E, T, A, 1]``, exactly 0 where ``mask`` is False.

    Raises:
        ValueError: on a shape or dtype that does not match ``state_value``.
    """
    from torchrl.objectives.value.functional import vtrace_advantage_estimate

    _check_float("behaviour_log_prob", behaviour_log_prob, state_value.shape)
    _check_float("target_log_prob", target_log_prob, state_value.shape)
    sv, nsv, r, d, term = _prepared(state_value, next_state_value, reward, done, terminated, mask, check=True)
    log_pi, log_mu = target_log_prob, behaviour_log_prob
    if mask is not None:
        present = mask.unsqueeze(-1)
        log_pi, log_mu = _zero_where_absent(present, log_pi), _zero_where_absent(present, log_mu)
    with torch.no_grad():
        # TorchRL names the target policy log_pi and the behaviour log_mu (rho = exp(log_pi - log_mu)).
        return vtrace_advantage_estimate(
            gamma, log_pi, log_mu, sv, nsv, r, d, term,
            rho_thresh=rho_thresh, c_thresh=c_thresh, time_dim=_TIME_DIM,
        )


def with_gae(rollout: TensorDictBase, group: str, gamma: float, lmbda: float) -> TensorDictBase:
    """Returns a shallow copy of ``rollout`` with ``(group, "advantage")`` and ``(group, "value_target")``.

    Reads ``(group, "state_value")``, ``("next", group, "state_value" | "reward" | "done" | "terminated")``,
    all ``[E, T, A, 1]``, and ``(group, "mask")`` ``[E, T, A]`` if present. Where a group flag is missing,
    the env-level ``("next", "done" | "terminated")`` ``[E, T, 1]`` is expanded over the agents explicitly.
    The caller's rollout is not modified. See :func:`gae` for the estimator and the module docstring for masks.

    Raises:
        KeyError: a required entry is missing.
        ValueError: an entry has the wrong shape or dtype (the message names the key).
    """
    sv, nsv, r, d, term, mask = _group_inputs(rollout, group)
    advantage, value_target = gae(sv, nsv, r, d, term, mask, gamma=gamma, lmbda=lmbda)
    return _with_outputs(rollout, group, advantage, value_target)


def with_vtrace(
    rollout: TensorDictBase,
    group: str,
    gamma: float,
    rho_thresh: float = 1.0,
    c_thresh: float = 1.0,
    *,
    target_log_prob: torch.Tensor,
) -> TensorDictBase:
    """Like :func:`with_gae`, with V-trace targets (see :func:`vtrace`).

    The behaviour log-probability is ``(group, "log_prob")`` ``[E, T, A, 1]`` (recorded when acting);
    ``target_log_prob`` ``[E, T, A, 1]`` is the log-probability of the same actions under the policy being
    trained (the caller re-evaluates it; it is used without gradient).

    Raises:
        KeyError: a required entry is missing.
        ValueError: an entry has the wrong shape or dtype (the message names the key).
    """
    sv, nsv, r, d, term, mask = _group_inputs(rollout, group)
    log_mu = _required(rollout, (group, LOG_PROB))
    _check_float(str((group, LOG_PROB)), log_mu, sv.shape)
    _check_float("target_log_prob", target_log_prob, sv.shape)
    advantage, value_target = vtrace(
        target_log_prob, log_mu, sv, nsv, r, d, term, mask, gamma=gamma, rho_thresh=rho_thresh, c_thresh=c_thresh
    )
    return _with_outputs(rollout, group, advantage, value_target)


def _group_inputs(rollout: TensorDictBase, group: str) -> tuple:
    """Reads and checks the estimator inputs of ``group``; names the offending key on error."""
    batch = group_of(rollout, group).batch_size  # [E, T, A]
    if len(batch) < 2:
        raise ValueError(f"{group!r} must have batch [env, time, agent...], got {list(batch)}")
    shape = torch.Size((*batch, 1))
    sv = _required(rollout, (group, STATE_VALUE))
    nsv = _required(rollout, (NEXT, group, STATE_VALUE))
    r = _required(rollout, (NEXT, group, REWARD))
    for key, x in (((group, STATE_VALUE), sv), ((NEXT, group, STATE_VALUE), nsv), ((NEXT, group, REWARD), r)):
        _check_float(str(key), x, shape)
    d, term = _flag(rollout, group, DONE, shape), _flag(rollout, group, TERMINATED, shape)
    mask = rollout.get((group, MASK), None)
    if mask is not None:
        _check_bool(str((group, MASK)), mask, batch)
    return sv, nsv, r, d, term, mask


def _flag(rollout: TensorDictBase, group: str, name: str, shape: torch.Size) -> torch.Tensor:
    """``("next", group, name)``, or the env-level ``("next", name)`` ``[E, T, 1]`` expanded to ``shape``."""
    key = (NEXT, group, name)
    flag = rollout.get(key, None)
    if flag is not None:
        _check_bool(str(key), flag, shape)
        return flag
    env_key = (NEXT, name)
    flag = rollout.get(env_key, None)
    if flag is None:
        raise KeyError(f"neither {key} nor the env-level {env_key} is in the rollout")
    _check_bool(str(env_key), flag, torch.Size((*shape[:2], 1)))
    return flag.reshape(*shape[:2], *([1] * (len(shape) - 2))).expand(shape)


def _with_outputs(rollout: TensorDictBase, group: str, advantage: torch.Tensor, value_target: torch.Tensor):
    out = rollout.copy()  # new containers, shared leaves: the caller's rollout is untouched
    out.set((group, ADVANTAGE), advantage)
    out.set((group, VALUE_TARGET), value_target)
    return out


def _checked(state_value, next_state_value, reward, done, terminated, mask) -> None:
    """Raises ValueError naming the input whose shape or dtype does not match ``state_value``'s."""
    shape = state_value.shape
    if state_value.ndim < 3 or shape[-1] != 1:
        raise ValueError(f"state_value must be [env, time, ..., 1], got {list(shape)}")
    _check_float("state_value", state_value, shape)
    _check_float("next_state_value", next_state_value, shape)
    _check_float("reward", reward, shape)
    _check_bool("done", done, shape)
    _check_bool("terminated", terminated, shape)
    if mask is not None:
        _check_bool("mask", mask, shape[:-1])


def _prepared(state_value, next_state_value, reward, done, terminated, mask, *, check: bool):
    """Checks shapes (``check``; :func:`gae` checks the whole batch before its chunks), then zeroes absent steps
    and cuts the trajectory around them (module docstring)."""
    if check:
        _checked(state_value, next_state_value, reward, done, terminated, mask)
    if mask is None:
        return state_value, next_state_value, reward, done, terminated
    present = mask.unsqueeze(-1)
    absent = ~present
    # A present step followed by an absent one ends its trajectory there (bootstrapped unless terminated).
    absent_next = torch.cat([absent[:, 1:], torch.zeros_like(absent[:, :1])], dim=_TIME_DIM)
    done = done | absent | absent_next
    return (
        _zero_where_absent(present, state_value),
        _zero_where_absent(present, next_state_value),
        _zero_where_absent(present, reward),
        done,
        terminated,
    )


def _zero_where_absent(present: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # where, not multiply: padding may hold NaN/inf, and 0 * NaN is NaN
    return torch.where(present, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _required(rollout: TensorDictBase, key: tuple) -> torch.Tensor:
    x = rollout.get(key, None)
    if x is None:
        raise KeyError(f"{key} is required but missing from the rollout")
    return x


def _check_float(name: str, x: torch.Tensor, shape: torch.Size) -> None:
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")


def _check_bool(name: str, x: torch.Tensor, shape: torch.Size) -> None:
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    if x.dtype != torch.bool:
        raise ValueError(f"{name}: expected dtype torch.bool, got {x.dtype}")
