"""Recurrent cells over one flat state tensor, and the unroll of a cell along a sequence (truncated BPTT).

A cell's state travels as one tensor ``[*B, S]`` so that actors, fragments, the wire and the inference
service carry it as one leaf whatever the cell: ``S = H`` for a GRU, ``S = 2H`` for an LSTM (``h`` then
``c``). The cell's output ``[*B, H]`` is the new ``h`` in both cases.

Sequences (:func:`unroll`) are ``[N, W, ...]``: ``N`` sequences of ``W`` steps. At the steps where
``start`` is True the state is read from the stored one (the state the actor used at that step: the first
step of a sequence, and every episode start, where the actor stored zeros); elsewhere it is carried from the
previous step, so gradients flow back through the whole sequence (Hausknecht & Stone 2015; R2D2, Kapturowski
et al. 2019, for stored states and burn-in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

CellKind = Literal["gru", "lstm"]
CELL_KINDS: tuple[str, ...] = ("gru", "lstm")


def make_cell(kind: CellKind, in_features: int, hidden: int) -> nn.Module:
    """A ``torch.nn.GRUCell`` or ``LSTMCell`` with orthogonal weights and zero biases (as MAPPO's GRU)."""
    if kind not in CELL_KINDS:
        raise ValueError(f"unknown recurrent cell {kind!r}: use one of {CELL_KINDS}")
    cell = (nn.GRUCell if kind == "gru" else nn.LSTMCell)(in_features, hidden)
    for name, p in cell.named_parameters():
        if name.startswith("weight"):
            nn.init.orthogonal_(p)
        else:
            nn.init.zeros_(p)
    return cell


def state_size(cell: nn.Module) -> int:
    """Width ``S`` of the flat state of ``cell``: ``H`` (GRU) or ``2H`` (LSTM)."""
    return cell.hidden_size * (2 if isinstance(cell, nn.LSTMCell) else 1)


def cell_step(cell: nn.Module, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One step of ``cell``: input ``[*B, F]``, flat state ``[*B, S]`` -> output ``[*B, H]``, next state ``[*B, S]``."""
    lead = x.shape[:-1]
    x2, s2 = x.reshape(-1, x.shape[-1]), state.reshape(-1, state.shape[-1])
    if isinstance(cell, nn.LSTMCell):
        h, c = cell(x2, tuple(s2.chunk(2, -1)))
        return h.reshape(*lead, -1), torch.cat((h, c), -1).reshape(*lead, -1)
    h = cell(x2, s2)
    return h.reshape(*lead, -1), h.reshape(*lead, -1)


def unroll(step: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], inputs: Tensor, stored: Tensor,
           start: Tensor) -> tuple[Tensor, Tensor]:
    """Runs ``step`` along the time dim of ``inputs``, carrying the state (gradients flow through it).

    Args:
        step: ``(x [N, *M, F], state [N, *M, S]) -> (out [N, *M, H], next state [N, *M, S])``, e.g.
            ``functools.partial(cell_step, cell)``; ``*M`` is e.g. the agent dim.
        inputs: ``[N, W, *M, F]``.
        stored: ``[N, W, *M, S]``: the state the actor used at each step (read where ``start``).
        start: bool ``[N, W]``: steps whose state is ``stored`` instead of the carried one; ``start[:, 0]``
            must be all True (a sequence's first state is its stored one).

    Returns:
        ``(outputs [N, W, *M, H], states [N, W, *M, S])``: ``states[:, t]`` is the state *after* step ``t``
        (the state a step ``t + 1`` of the same episode starts from).
    """
    n, w = inputs.shape[:2]
    if start.shape != (n, w):
        raise ValueError(f"start must be [{n}, {w}] like the inputs' leading dims, got {tuple(start.shape)}")
    load = start.reshape(n, w, *(1,) * (stored.dim() - 2))
    outputs, states, state = [], [], stored[:, 0]
    for t in range(w):
        state = torch.where(load[:, t], stored[:, t], state) if t else stored[:, 0]
        out, state = step(inputs[:, t], state)
        outputs.append(out)
        states.append(state)
    return torch.stack(outputs, 1), torch.stack(states, 1)


__all__ = ["CELL_KINDS", "CellKind", "cell_step", "make_cell", "state_size", "unroll"]
