"""OptimizerStep: the direct fused-Adam call updates exactly as ``optimizer.step()`` does, and steps aside."""

from __future__ import annotations

import torch

from core.losses.adam_step import OptimizerStep


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _grads_(net: torch.nn.Module, k: int, skip: str | None = None) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for name, p in net.named_parameters():
        p.grad = None if name == skip else torch.randn(p.shape, generator=g)


def _run(direct: bool, skip_at: int | None = None) -> tuple[torch.nn.Module, torch.optim.Adam]:
    net = _net(0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, eps=1e-5, fused=True)
    step = OptimizerStep(opt) if direct else opt.step
    for k in range(12):
        _grads_(net, k, skip="2.bias" if k == skip_at else None)
        if k == 6:
            opt.param_groups[0]["lr"] = 1e-3  # annealing between steps is honoured
        step()
    return net, opt


def test_direct_fused_adam_equals_optimizer_step_bit_for_bit():
    (net_a, opt_a), (net_b, opt_b) = _run(direct=False), _run(direct=True)
    for (name, a), b in zip(net_a.named_parameters(), net_b.parameters()):
        assert torch.equal(a, b), name
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq")), name


def test_a_parameter_without_gradient_goes_through_optimizer_step():
    (net_a, _), (net_b, _) = _run(direct=False, skip_at=8), _run(direct=True, skip_at=8)
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(a, b)


def test_hooks_and_other_optimizers_use_optimizer_step():
    net = _net(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    calls = []
    step = OptimizerStep(opt)
    for k in range(3):  # the direct path is in use after the first step ...
        _grads_(net, k)
        step()
    opt.register_step_post_hook(lambda *_: calls.append(1))  # ... and a hook registered now still runs
    for k in range(3):
        _grads_(net, k)
        step()
    assert len(calls) == 3  # every step after the hook ran through optimizer.step()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    step = OptimizerStep(sgd)
    step()
    step()
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
