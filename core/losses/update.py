"""The one effectful step of PPO: epochs x minibatches of SGD on a policy's parameters, with a NaN/Inf guard."""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Iterable, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from core.buffers.batching import GATHER_ROWS, gathered_minibatches
from core.layout import (ADVANTAGE, ENV_ID, EPISODE_ID, FRAGMENT_ID, LOG_PROB, MASK, NEXT, POLICY_VERSION,
                         STATE_VALUE, VALUE_TARGET, WORKER_ID, group_of)
from core.losses.adam_step import OptimizerStep
from core.losses.config import PPOConfig
from core.losses.ppo import (DIAGNOSTIC_KEYS, ENTROPY, LOSS_KEYS, check_shapes, diagnostic_moments, loss_terms,
                             merge_moments, moment_diagnostics)

Evaluate = Callable[[TensorDictBase], Mapping[str, torch.Tensor]]
"""``evaluate(minibatch) -> {"log_prob", "state_value", "entropy"}``, each ``[n, A, 1]`` with gradients."""

_BEHAVIOUR_KEYS = (ADVANTAGE, LOG_PROB, STATE_VALUE, VALUE_TARGET)
#: Entries no minibatch needs: dropped once, so each epoch's permutation indexes fewer tensors
_UNUSED_KEYS = (NEXT, POLICY_VERSION, WORKER_ID, FRAGMENT_ID, EPISODE_ID, ENV_ID)


def ppo_update_(
    params: torch.nn.Module | Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch: TensorDictBase,
    evaluate: Evaluate,
    cfg: PPOConfig,
    generator: torch.Generator,
    *,
    group: str,
) -> TensorDict:
    """Trains one policy on one agent group: ``cfg.num_epochs`` x minibatches of clipped-PPO SGD.

    Mutates ``params`` (their values and ``.grad``) and ``optimizer`` (its state), nothing else.

    Data: ``batch`` is flat, batch ``[N]`` at the root (a rollout after ``reshape(-1)``), with ``batch[group]``
    of batch ``[N, A]`` holding ``advantage``, ``log_prob``, ``state_value``, ``value_target`` ``[N, A, 1]``
    and optionally ``mask`` ``[N, A]``. ``("next", ...)`` entries and the fragment metadata (policy version,
    worker, fragment, episode and env ids) are dropped before minibatching (PPO does not read them).
    Each epoch takes the minibatches of :func:`core.buffers.minibatches` (the function whose partition
    properties the tests check): one ``torch.randperm(N, generator=generator)``, minibatches of
    ``cfg.minibatch_size`` transitions (the last may be smaller): every transition is used once per epoch
    (detail 6), and the agents of a transition stay together. They are copied out of the batch a chunk of
    minibatches at a time (:func:`core.buffers.gathered_minibatches`), and what is reported is summed as it
    goes (losses per step, diagnostics' moments per chunk of steps): an update holds its batch and a bounded
    remainder, whatever its size.

    ``evaluate(minibatch)`` gets the root minibatch (batch ``[n]``, so it can read ``("shared", ...)`` or
    other groups, e.g. for a centralised critic) and returns a TensorDict or plain dict with ``log_prob``,
    ``state_value`` and ``entropy`` of ``minibatch[group]``, each ``[n, A, 1]``, computed with gradients by
    the modules that own ``params``. Several groups or policies: call ``ppo_update_`` once per (policy,
    group) with that policy's optimizer; one policy is trained on one group per call.

    Per minibatch: ``evaluate`` (under ``torch.autocast`` when ``cfg.compute_dtype`` is ``bfloat16``; its
    outputs are read as float32), loss (:func:`core.losses.ppo.loss_terms`), ``backward``, the total gradient
    norm, then a guard: if the loss or that norm is not finite (any non-finite gradient makes the norm
    non-finite), the gradients are discarded and ``optimizer.step()`` is skipped, leaving parameters and
    optimizer state untouched; the step is counted in ``skipped_steps``. Otherwise gradients are clipped to global norm
    ``cfg.max_grad_norm`` (detail 11; same factor as ``torch.nn.utils.clip_grad_norm_``) and the optimizer
    steps. Reading loss and norm on the host is the one sync per minibatch; diagnostics are reduced without
    one. Gradients of ``params`` and of the optimizer's parameters are reset to None before each backward
    and after a skipped step. Recommended optimizer (CPU, notes/tensordict-hot-paths.md pattern 6; detail 3):
    ``torch.optim.Adam(params, lr=3e-4, eps=1e-5, fused=True)``, whose kernel is then called directly after
    the first step (:class:`core.losses.adam_step.OptimizerStep`: the same update, ~60 µs less per step).

    Args:
        params: the trained parameters (a module or an iterable of tensors): clipped and checked.
        optimizer: steps ``params``.
        batch: flat batch ``[N]``, see above.
        evaluate: the policy and critic forward pass on a minibatch, see above.
        cfg: PPO hyper-parameters (``num_epochs``, ``minibatch_size``, ``max_grad_norm``, ``target_kl``, ...).
        generator: source of the permutations (same seed, same data, same parameters: same result).
        group: the agent group trained.

    Returns:
        TensorDict, batch ``[]``: means over the applied (not skipped) steps of ``loss_policy``,
        ``loss_value``, ``loss_entropy`` and the pre-clip ``grad_norm``; ``approx_kl``, ``clip_fraction``,
        ``entropy`` and ``explained_variance`` over the valid entries of the applied minibatches (the
        minibatch mean when minibatches are full and unmasked; NaN if nothing was applied); int64
        ``skipped_steps``, ``num_minibatches`` (run, skipped included) and ``num_epochs`` (run; fewer than
        ``cfg.num_epochs`` when ``cfg.target_kl`` stopped the update).

    Raises:
        KeyError: a required entry of ``batch[group]`` is missing.
        ValueError: the batch is not flat, or an entry of ``batch[group]`` or of ``evaluate``'s output has the
            wrong shape.
    """
    params = [p for p in (params.parameters() if isinstance(params, torch.nn.Module) else params)
              if p.requires_grad]
    # Gradients are reset by hand (set to None, as zero_grad(set_to_none=True) does) on the union of the
    # trained and the optimizer's parameters: 20 us a step cheaper than Optimizer.zero_grad here.
    stepped = (q for g in optimizer.param_groups for q in g["params"])
    owned = list({id(p): p for p in (*params, *stepped)}.values())
    data, _ = _prepared(batch, group)
    step = OptimizerStep(optimizer)  # optimizer.step(), or fused Adam's kernel called directly
    tally = _Tally(cfg)
    autocast = mixed_precision(params[0].device if params else "cpu", cfg.compute_dtype)
    skipped = num_minibatches = epochs = 0
    for _ in range(cfg.num_epochs):
        epochs += 1
        epoch_skipped, epoch_applied = _epoch(params, owned, step, data, evaluate, cfg, generator, group, tally,
                                              autocast)
        skipped += epoch_skipped
        num_minibatches += epoch_skipped + epoch_applied
        kl = tally.end_epoch()
        if kl is not None and kl > cfg.target_kl:  # one sync per epoch
            break
    return _metrics(tally, skipped, num_minibatches, epochs)


class _Tally:
    """What the update reports, summed as it goes: the losses and gradient norm of the applied steps, and the
    diagnostics' moments (:func:`core.losses.ppo.diagnostic_moments`) over chunks of :data:`_CHUNK` steps.
    Nothing per step outlives its chunk: per-step survivors would pin the allocator's freed blocks (at 1M
    transitions the heap kept hundreds of MB of them) and keep the chunks of shuffled copies alive."""

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg
        self.losses: torch.Tensor | None = None  # [4] float64: loss_policy, loss_value, loss_entropy, grad_norm
        self.applied = 0
        self.kept: list[tuple] = []
        self.parts: list[torch.Tensor] = []  # [8] moments per chunk, merged once at the end
        self._epoch_start = 0

    def add(self, losses: torch.Tensor, diagnostic_inputs: tuple) -> None:
        self.losses = losses.to(torch.float64) if self.losses is None else self.losses.add_(losses)
        self.applied += 1
        self.kept.append(diagnostic_inputs)
        if len(self.kept) == _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self.kept:
            self.parts.append(diagnostic_moments(
                *(None if p[0] is None else torch.cat(p) for p in zip(*self.kept)), self.cfg))
            self.kept = []

    def end_epoch(self) -> torch.Tensor | None:
        """Ends an epoch (its inputs are views of the epoch's shuffled chunks: released here); the epoch's
        approximate KL if ``target_kl`` is set and it applied a step, else None."""
        self._flush()
        epoch, self._epoch_start = self.parts[self._epoch_start:], len(self.parts)
        if self.cfg.target_kl is None or not epoch:
            return None
        return moment_diagnostics(merge_moments(torch.stack(epoch)))[0]

    def diagnostics(self) -> torch.Tensor | None:
        """``[approx_kl, clip_fraction, entropy, explained_variance]`` over every applied step, or None."""
        return moment_diagnostics(merge_moments(torch.stack(self.parts))) if self.parts else None


#: Applied steps whose diagnostic inputs are reduced to moments together. Few enough that the float64
#: temporaries of the reduction and the shuffled chunks the kept inputs pin stay small beside the batch
#: (at 64 steps they were the update's peak: half the fragment at 1,024 CartPoles x 64 steps,
#: ``benchmarks/transition_memory.py``); enough that the reduction's ops are a small part of a step
#: (``benchmarks/ppo_update.py`` was level with 64).
_CHUNK = 16


def _epoch(params: list[torch.Tensor], owned: list[torch.Tensor], step: OptimizerStep, data: TensorDictBase,
           evaluate: Evaluate, cfg: PPOConfig, generator: torch.Generator, group: str,
           tally: _Tally, autocast: Callable[[], torch.autocast] | None) -> tuple[int, int]:
    """One epoch of minibatch steps, reported to ``tally``; ``(steps skipped, steps applied)``. A function of
    its own so that nothing of the epoch's shuffled chunks of ``data`` outlives it."""
    skipped = applied = 0
    # a row is a transition, or a whole sequence of W steps for a recurrent policy ([S, W, A] groups)
    per_row = data.get(group).batch_size[1:-1].numel()
    for mb in gathered_minibatches(data, cfg.minibatch_size, generator, chunk_rows=max(1, GATHER_ROWS // per_row)):
        behaviour = mb.get(group)
        adv, old_lp, old_v, target = (behaviour.get(k) for k in _BEHAVIOUR_KEYS)
        mask = behaviour.get(MASK, None)
        if autocast is None:
            current = evaluate(mb)
            lp, value, entropy = current[LOG_PROB], current[STATE_VALUE], current[ENTROPY]
        else:  # mixed precision: the loss and what it is read against stay float32
            with autocast():
                current = evaluate(mb)
            lp, value, entropy = (current[k].float() for k in (LOG_PROB, STATE_VALUE, ENTROPY))
        if not adv.shape == lp.shape == value.shape == entropy.shape:
            check_shapes(adv.shape, behaviour, current, mask)  # raises, naming the entry
        loss_policy, loss_value, loss_entropy, log_ratio = loss_terms(
            adv, old_lp, old_v, target, lp, value, entropy, mask, cfg, sanitize=False
        )
        loss = loss_policy + loss_value + loss_entropy
        _clear_grads(owned)
        loss.backward()
        grad_norm = _clip_grad_norm_(params, cfg.max_grad_norm, loss)
        if grad_norm is None:  # non-finite loss or gradient: skip, params and optimizer state untouched
            _clear_grads(owned)
            skipped += 1
            continue
        step()
        applied += 1
        with torch.no_grad():
            tally.add(torch.stack((loss_policy, loss_value, loss_entropy, grad_norm)),
                      (log_ratio, value.detach(), target, entropy.detach(), mask))
    return skipped, applied


def mixed_precision(device: torch.device | str, compute_dtype: str) -> Callable[[], torch.autocast] | None:
    """``PPOConfig.compute_dtype`` as a context factory for the forward passes of an update on ``device``:
    ``torch.autocast`` to that dtype, or None for ``float32`` (nothing to enter)."""
    if compute_dtype == "float32":
        return None
    return functools.partial(torch.autocast, torch.device(device).type, dtype=getattr(torch, compute_dtype))


def _clear_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _clip_grad_norm_(params: list[torch.Tensor], max_norm: float | None, loss: torch.Tensor) -> torch.Tensor | None:
    """Clips gradients to global norm ``max_norm``; returns the pre-clip norm, or None if it or the loss is not finite.

    Bit for bit the factor of ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``, evaluated as
    torch evaluates it in the gradients' dtype); nothing is clipped when None is returned. The norm comes to
    the host anyway for the finite check (the one sync of a step), so for float32 gradients the factor is
    computed on the host in float32 arithmetic: about half the cost of ``clip_grad_norm_`` (~95 vs ~180 us
    here, 12 tensors). Being bit-identical matters: training amplifies a last-bit difference in the updates,
    so two otherwise identical PPO runs drift apart (CartPole: parameters 4e-7 apart after 8 iterations, 6e-3
    after 14), and ``benchmarks/cartpole_time_to_450.py`` pairs ours and a hand-written PPO on the same
    random streams.
    Assumes the gradients share one device.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        norm = torch.zeros((), device=loss.device)
    else:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    norm_f = norm.item()
    if not (math.isfinite(norm_f) and math.isfinite(loss.item())):
        return None
    if max_norm is not None and grads:
        coef = _clip_factor(norm, norm_f, max_norm)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return norm


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (a float32 operation is its exact result rounded once)."""
    return _F32.unpack(_F32.pack(x))[0]


_F32 = struct.Struct("f")


def _clip_factor(norm: torch.Tensor, norm_f: float, max_norm: float) -> float:
    """``max_norm / (norm + 1e-6)`` as ``clip_grad_norm_`` computes it: ``(norm + 1e-6).reciprocal() *
    max_norm`` in ``norm``'s dtype (``Tensor.__rdiv__``), each step rounded to float32 for float32 norms."""
    if norm.dtype == torch.float32:
        return _f32(_f32(1.0 / _f32(norm_f + _f32(1e-6))) * _f32(max_norm))
    if norm.dtype == torch.float64:
        return (1.0 / (norm_f + 1e-6)) * max_norm
    return float(max_norm / (norm + 1e-6))


def _prepared(batch: TensorDictBase, group: str) -> tuple[TensorDictBase, int]:
    """Checks the flat batch once; drops ``next``; zeroes behaviour entries of absent agents once."""
    if batch.batch_dims != 1:
        raise ValueError(f"batch must be flat (batch [N]), got batch {list(batch.batch_size)}")
    data = batch.exclude(*_UNUSED_KEYS)
    g = group_of(data, group)
    shape = torch.Size((*g.batch_size, 1))
    for key in _BEHAVIOUR_KEYS:
        x = g.get(key, None)
        if x is None:
            raise KeyError(f"{(group, key)} is required but missing from the batch")
        if x.shape != shape:
            raise ValueError(f"{(group, key)}: expected shape {list(shape)}, got {list(x.shape)}")
    mask = g.get(MASK, None)
    if mask is not None:
        if mask.shape != shape[:-1] or mask.dtype != torch.bool:
            raise ValueError(f"{(group, MASK)}: expected bool {list(shape[:-1])}, got {mask.dtype} "
                             f"{list(mask.shape)}")
        g = g.copy()  # padding may hold NaN: zero it here once rather than in every minibatch
        valid = mask.unsqueeze(-1)
        for key in _BEHAVIOUR_KEYS:
            g.set(key, torch.where(valid, g.get(key), 0.0))
        data = data.copy().set(group, g)
    return data, batch.batch_size[0]


def _metrics(tally: _Tally, skipped: int, num_minibatches: int, epochs: int) -> TensorDict:
    nan = torch.full((len(LOSS_KEYS) + 1,), torch.nan)
    losses = (tally.losses / tally.applied).to(torch.float32) if tally.applied else nan
    diag = tally.diagnostics()
    diag = nan[: len(DIAGNOSTIC_KEYS)] if diag is None else diag
    out = dict(zip((*LOSS_KEYS, "grad_norm"), losses.unbind()))
    out.update(zip(DIAGNOSTIC_KEYS, diag.unbind()))
    out.update(skipped_steps=torch.tensor(skipped), num_minibatches=torch.tensor(num_minibatches),
               num_epochs=torch.tensor(epochs))
    return TensorDict(out, batch_size=[])
