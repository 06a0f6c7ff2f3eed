"""tanh on CPU: ``torch.tanh`` against Shoal's ``core.policies.fast_tanh.tanh`` (``2 * sigmoid(2x) - 1``).

For the activation shapes of the project's workloads (rows x width: CartPole minibatches, below and at the
size from which the identity is used, a CartPole acting batch, a 16k-env batch, a VMAS MAPPO minibatch's actor
and critic), times the identity's forward alone (no graph) and forward + backward
(training: the only place Shoal uses the identity; acting keeps ``torch.tanh``), interleaved over rounds;
reports each side's median in microseconds per call, the speed-up, and the largest absolute difference of the
values. Prints one JSON.

    python benchmarks/activation_cost.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from core.policies.fast_tanh import FAST_MIN_ELEMENTS, sigmoid_tanh, tanh


def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    """The identity at every size (the module's threshold is what this benchmark measures): the autograd
    function where gradients are recorded, else the bare identity (Shoal itself acts with ``torch.tanh``)."""
    return tanh(x, min_elements=0) if torch.is_grad_enabled() else sigmoid_tanh(x)

SHAPES = {"cartpole_minibatch_256x64": (256, 64), "cartpole_update_512x64": (512, 64),
          "cartpole_act_1024x64": (1024, 64), "cartpole_act_16384x64": (16384, 64),
          "mappo_actor_1200x256": (1200, 256), "mappo_critic_400x256": (400, 256)}


def seconds_per_call(fn, x: torch.Tensor, backward: bool, budget: float = 0.2) -> float:
    grad = torch.ones_like(x)

    def call() -> None:
        if backward:
            fn(x).backward(grad)
        else:
            with torch.no_grad():
                fn(x)
    for _ in range(3):
        call()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        call()
        count += 1
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    result: dict = {"benchmark": "activation_cost", "threads": args.threads, "torch": torch.__version__,
                    "unit": "us per call", "fast_min_elements": FAST_MIN_ELEMENTS}
    for name, shape in SHAPES.items():
        x = (torch.randn(*shape, generator=g) * 2).requires_grad_()
        with torch.no_grad():
            entry: dict = {"max_abs_diff": float((sigmoid_tanh(x) - torch.tanh(x)).abs().max())}
        for mode, backward in (("forward", False), ("forward_backward", True)):
            times: dict[str, list[float]] = {"torch_tanh": [], "shoal_tanh": []}
            for _ in range(args.rounds):
                times["torch_tanh"].append(seconds_per_call(torch.tanh, x, backward))
                times["shoal_tanh"].append(seconds_per_call(fast_tanh, x, backward))
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            entry[mode] = {**{k: round(v, 1) for k, v in med.items()},
                           "speedup": round(med["torch_tanh"] / med["shoal_tanh"], 2)}
        result[name] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
