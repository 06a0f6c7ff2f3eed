"""CPU a fresh process spends importing what a rollout worker imports, with and without the dynamo deferral.

Every Ray rollout worker, env-worker forkserver and external-simulator server is a new Python process that
imports torch and tensordict. tensordict's import also imports ``torch._dynamo`` (through
``torch.compiler.allow_in_graph``), and torchrl's does (its replay buffers), though a process that only samples
never compiles anything. Shoal defers both (:mod:`core.dynamo_deferral`; torchrl imported where a spec is
converted or an advantage estimated). Ours: a fresh process importing ``--modules`` as Shoal does; reference,
in the same run: the same with the deferral off (``SHOAL_DEFER_DYNAMO=0``; torchrl imported first, as a module
that imports it at the top would). Figures: the child's user + system CPU seconds, medians over interleaved
repeats; ``ratio`` = ours / reference.

    python benchmarks/worker_start.py [--repeats 5] [--modules orchestration.ray_fleet]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child_cpu_s(modules: list[str], defer: bool) -> tuple[float, bool]:
    """CPU seconds of one fresh process importing ``modules``; whether it imported torch._dynamo."""
    first = [] if defer else ["torchrl.data"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in [*first, *modules]) + \
        "print('torch._dynamo' in sys.modules)"
    env = {**os.environ, "SHOAL_DEFER_DYNAMO": "1" if defer else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, out.stdout.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modules", nargs="+", default=["orchestration.ray_fleet"])
    args = parser.parse_args()
    ours, reference, dynamo = [], [], {}
    for _ in range(args.repeats):  # interleaved: a busy moment slows both alike
        cpu, dynamo["ours"] = _child_cpu_s(args.modules, defer=True)
        ours.append(cpu)
        cpu, dynamo["reference"] = _child_cpu_s(args.modules, defer=False)
        reference.append(cpu)
    print(json.dumps({"benchmark": "worker_start", "modules": args.modules, "repeats": args.repeats,
                      "ours_cpu_s": round(statistics.median(ours), 3),
                      "reference_cpu_s": round(statistics.median(reference), 3),
                      "ratio": round(statistics.median(ours) / statistics.median(reference), 3),
                      "imports_dynamo": dynamo, "ours_runs": [round(x, 3) for x in ours],
                      "reference_runs": [round(x, 3) for x in reference]}))


if __name__ == "__main__":
    main()
