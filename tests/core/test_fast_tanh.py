"""``core.policies.fast_tanh``: tanh by ``2 * sigmoid(2x) - 1`` on large CPU tensors, tanh's values and gradient."""

from __future__ import annotations

import torch

from core.policies import mlp
from core.policies.fast_tanh import FAST_MIN_ELEMENTS, Tanh, tanh

TOLERANCE = 2.4e-7  # the module docstring's bound: a couple of float32 steps near +-1


def _inputs() -> torch.Tensor:
    """Every region of tanh: the flat tails, the steep middle, the tiny, the extreme, in float32."""
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 9.0, -9.0, 44.0, -44.0, 88.7, -88.7, 1e4, -1e4,
                            3.4e38, -3.4e38])
    return torch.cat((torch.linspace(-20, 20, 200_001), torch.randn(50_000) * 1e-3, special))


def test_values_match_torch_tanh_within_float32_rounding():
    x = _inputs().requires_grad_()
    assert x.numel() >= FAST_MIN_ELEMENTS
    fast, exact = tanh(x).detach(), torch.tanh(x).detach()
    assert (fast - exact).abs().max().item() <= TOLERANCE
    assert fast.abs().max().item() <= 1.0  # never outside tanh's range
    # the reference in float64 too: the identity's float32 error, not only its difference from torch's
    assert (fast.double() - torch.tanh(x.double())).abs().max().item() <= TOLERANCE


def test_infinities_and_nan():
    x = torch.zeros(FAST_MIN_ELEMENTS)
    x[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    y = tanh(x.requires_grad_()).detach()
    assert y[0].item() == 1.0 and y[1].item() == -1.0 and torch.isnan(y[2])


def test_gradient_is_tanhs_own():
    """Given the same output ``y``, the gradient is ``grad * (1 - y^2)`` by the kernel ``torch.tanh``'s own
    backward runs, so it equals that bit for bit; against ``torch.tanh``'s gradient at its own (rounded
    differently) output, within float32 rounding."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 256, generator=g) * 3).requires_grad_()
    upstream = torch.randn(300, 256, generator=g)
    y = tanh(x)
    (grad,) = torch.autograd.grad(y, x, upstream)
    assert torch.equal(grad, torch.ops.aten.tanh_backward(upstream, y.detach()))
    assert (grad - upstream * (1 - y.detach() ** 2)).abs().max().item() <= 1e-6
    x_ref = x.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(torch.tanh(x_ref), x_ref, upstream)
    assert (grad - grad_ref).abs().max().item() <= 1e-6 * upstream.abs().max().item()


def test_gradcheck_in_float64():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: tanh(t, min_elements=0), (x,))
    assert torch.autograd.gradgradcheck(lambda t: tanh(t, min_elements=0), (x,))


def test_small_or_integer_tensors_are_torch_tanh_exactly():
    x = torch.linspace(-5, 5, FAST_MIN_ELEMENTS - 1)
    assert torch.equal(tanh(x), torch.tanh(x))
    half = torch.linspace(-5, 5, FAST_MIN_ELEMENTS, dtype=torch.bfloat16)
    assert torch.equal(tanh(half), torch.tanh(half))


def test_acting_and_value_passes_get_torch_tanh_exactly():
    """Without autograd recording (acting, values), torch's own values: an action does not depend on the batch."""
    x = torch.randn(4 * FAST_MIN_ELEMENTS, requires_grad=True) * 3
    with torch.no_grad():
        assert torch.equal(tanh(x), torch.tanh(x)) and tanh(x).grad_fn is None
    assert torch.equal(tanh(x.detach()), torch.tanh(x.detach()))
    assert not torch.equal(tanh(x).detach(), torch.tanh(x).detach())  # training: the identity (rounded otherwise)


def test_mlp_uses_it_and_an_exported_policy_holds_plain_tanh():
    trunk = mlp(8, (256, 256), "tanh", 1.0)
    assert [type(m) for m in trunk] == [torch.nn.Linear, Tanh, torch.nn.Linear, Tanh]
    x = torch.randn(128, 8)
    reference = torch.nn.Sequential(trunk[0], torch.nn.Tanh(), trunk[2], torch.nn.Tanh())(x)
    assert (trunk(x) - reference).abs().max().item() <= 2 * TOLERANCE
    program = torch.export.export(trunk, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert torch.ops.aten.tanh.default in targets and torch.ops.aten.sigmoid_.default not in targets
    assert torch.equal(program.module()(x), torch.tanh(trunk[2](torch.tanh(trunk[0](x)))).detach())
