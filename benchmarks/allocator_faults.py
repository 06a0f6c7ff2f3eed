"""Page faults and step time with glibc's default malloc thresholds against ``orchestration.allocator``'s.

Each measure runs in a fresh child process (the thresholds cannot be unset in a process), ``default`` and
``tuned`` children alternating over ``--rounds``: a 2 x 256 tanh MLP's forward and backward on 1,200 rows of
18 features (a VMAS MAPPO minibatch's actor), and with ``--vmas`` one iteration of Shoal's MAPPO on VMAS
navigation (``benchmarks/vmas_mappo.py``'s settings). Reported per measure and setting: median milliseconds per
step and minor page faults per step (``getrusage``), and the time ratio default / tuned. Prints one JSON.

    python benchmarks/allocator_faults.py [--rounds 3] [--vmas]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(measure: str, tuned: bool) -> dict:
    """Runs in the child: ``{"ms": median ms per step, "faults": minor faults per step}``."""
    import torch

    torch.set_num_threads(1)
    if tuned:
        from orchestration.allocator import keep_freed_memory
        assert keep_freed_memory(), "the allocator could not be tuned on this machine"
    if measure == "mlp":
        from core.policies import mlp

        net = torch.nn.Sequential(mlp(18, (256, 256), "tanh", 1.0), torch.nn.Linear(256, 2))
        x = torch.randn(1200, 18)

        def step() -> None:
            net(x).square().mean().backward()
        warm, steps = 5, 100
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import vmas_mappo

        run, _ = vmas_mappo.shoal("joint", 0)

        def step() -> None:
            run(1)
        warm, steps = 1, 3
    for _ in range(warm):
        step()
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"ms": statistics.median(times) * 1e3, "faults": faults / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vmas", action="store_true", help="also one Shoal MAPPO iteration on VMAS navigation")
    parser.add_argument("--child", nargs=2, metavar=("MEASURE", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "tuned")))
        return
    result: dict = {"benchmark": "allocator_faults", "rounds": args.rounds}
    for measure in ("mlp", "vmas_iteration") if args.vmas else ("mlp",):
        runs: dict[str, list[dict]] = {"default": [], "tuned": []}
        for _ in range(args.rounds):
            for setting in runs:
                out = subprocess.run([sys.executable, __file__, "--child", measure, setting], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout
                runs[setting].append(json.loads(out.strip().splitlines()[-1]))
        med = {s: {k: statistics.median(r[k] for r in rs) for k in ("ms", "faults")} for s, rs in runs.items()}
        result[measure] = {**{s: {"ms_per_step": round(m["ms"], 2), "faults_per_step": round(m["faults"], 1)}
                              for s, m in med.items()},
                           "time_default_vs_tuned": round(med["default"]["ms"] / med["tuned"]["ms"], 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
