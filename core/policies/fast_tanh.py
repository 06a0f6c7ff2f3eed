"""tanh in training on large float CPU tensors as ``2 * sigmoid(2x) - 1``: the same function, half the cost.

torch's CPU tanh kernel is several times slower than its sigmoid kernel on this project's machines (AVX2), and
in a 2 x 256 tanh MLP trained on CPU the hidden layers' tanh was a fifth of an update (``aten::tanh`` in a
profile of ``benchmarks/vmas_mappo.py``). ``tanh(x) = 2 * sigmoid(2x) - 1`` exactly; computed in float32
the two agree to within 2.4e-7 absolute (a couple of float32 steps near +-1, where ``tanh`` is flattest): far
below what a policy's outputs can tell apart. ``benchmarks/activation_cost.py`` measures both.

The identity serves training only: where autograd records (an update's minibatches, whose size the config
fixes). Everywhere else :class:`Tanh` is ``torch.tanh`` itself, so that acting and value passes give torch's
exact values whatever their batch: a deterministic action does not depend on how many other requests an
inference batch held, nor on how a batch was chunked (and Shoal's PPO stays bit for bit a hand-written one's,
the pairing of ``benchmarks/cartpole_time_to_450.py``). Nor is the identity used for:
- a tensor under :data:`FAST_MIN_ELEMENTS` elements (there, four kernel launches cost more than one);
- a tensor not on the CPU (a GPU's tanh is one fused elementwise kernel; the identity would be four);
- a dtype other than float32 / float64;
- under ``torch.compile`` or ``torch.export`` (an exported policy holds a plain ``tanh``; a compiler fuses).

The gradient is tanh's own, ``grad * (1 - y^2)`` from the output ``y`` (``aten.tanh_backward``, the kernel
autograd runs for ``torch.tanh``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: Below this many elements :class:`Tanh` calls ``torch.tanh``: four kernel launches (and, training, the
#: autograd function's own cost) outweigh the cheaper kernel there. Measured crossover: forward and backward of
#: a 16,384-element activation were slower by the identity, of 32,768 faster (``benchmarks/activation_cost.py``).
FAST_MIN_ELEMENTS = 32768

_FAST_DTYPES = (torch.float32, torch.float64)


def sigmoid_tanh(x: Tensor) -> Tensor:
    """``2 * sigmoid(2x) - 1`` into one new tensor (one allocation, then in place), no autograd graph."""
    return x.mul(2).sigmoid_().mul_(2).sub_(1)


class _SigmoidTanh(torch.autograd.Function):
    """:func:`sigmoid_tanh` with tanh's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = sigmoid_tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


def tanh(x: Tensor, min_elements: int = FAST_MIN_ELEMENTS) -> Tensor:
    """``torch.tanh(x)``, by :func:`sigmoid_tanh` in training where that is faster (module docstring). Any shape.

    ``min_elements``: the size from which the identity is used (tests pass 0)."""
    # compiling or exporting first: a traced batch size is symbolic, and comparing it would guard on it
    if (torch.compiler.is_compiling() or torch.compiler.is_exporting() or not x.requires_grad
            or not torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype not in _FAST_DTYPES
            or x.numel() < min_elements):
        return torch.tanh(x)
    return _SigmoidTanh.apply(x)


class Tanh(nn.Module):
    """``nn.Tanh`` computed by :func:`tanh` (no parameters, no state: a drop-in in ``nn.Sequential``)."""

    def forward(self, x: Tensor) -> Tensor:
        return tanh(x)
