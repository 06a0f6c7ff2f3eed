"""``[4, n]`` -> ``[n, 4]`` float32 transposes that are faster on CPU than ``t().contiguous()`` at large ``n``.

A strided copy with an inner dimension of 4 is slow on CPU (torch's copy kernel vectorises along the
destination's contiguous dim, here only 4 wide). :func:`rows_to_columns` builds the same bytes with two
interleaves instead, each a contiguous, vectorised kernel: ``torch.complex(a, b)`` writes ``a[i], b[i]``
side by side, so rows 0/1 and rows 2/3 become ``[n]`` complex64 pairs; each pair's 8 bytes, read as one
float64, is interleaved again by a complex128 ``torch.complex``. Only reinterpretations (``view``) and
copies touch the values, never arithmetic, so the result is bit-identical to ``t().contiguous()`` for every
bit pattern (NaN payloads included: ``tests/adapters/test_transpose.py``).
``benchmarks/builtin_throughput.py`` measures the env step it serves; below :data:`INTERLEAVE_FROM` columns
(or off the CPU) the plain copy is as fast or faster and is used.
"""

from __future__ import annotations

import torch

#: Columns from which the interleaving beats the strided copy on CPU (scratch runs, 1 thread: about even at
#: 4,096, well ahead at 16,384).
INTERLEAVE_FROM = 8192


def rows_to_columns(rows: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous ``[n, 4]`` tensor equal, bit for bit, to ``rows.t()`` (``rows``: ``[4, n]``, any dtype
    and device; the interleaving path serves contiguous float32 CPU rows with ``n >= INTERLEAVE_FROM``)."""
    if (rows.shape[1] < INTERLEAVE_FROM or rows.shape[0] != 4 or rows.dtype != torch.float32
            or rows.device.type != "cpu" or not rows.is_contiguous()):  # the cheapest test first: small batches
        return rows.t().contiguous()
    low = torch.view_as_real(torch.complex(rows[0], rows[1])).view(torch.float64).squeeze(-1)  # [n] (r0, r1)
    high = torch.view_as_real(torch.complex(rows[2], rows[3])).view(torch.float64).squeeze(-1)  # [n] (r2, r3)
    return torch.view_as_real(torch.complex(low, high)).view(torch.float32)  # [n, 2, 2] float64 pairs -> [n, 4]


__all__ = ["INTERLEAVE_FROM", "rows_to_columns"]
