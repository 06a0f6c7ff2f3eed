"""core.dynamo_deferral: tensordict imported without torch._dynamo leaves dynamo, once imported, in the state a
plain import leaves it in; a rollout worker's modules import neither dynamo nor torchrl."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Every callable of every tensordict module (and of its classes): is dynamo told to put it in the graph, and is
# it marked as having a constant result?
_SCAN = """
import json, sys
import core  # installs the deferral unless SHOAL_DEFER_DYNAMO=0
import tensordict, tensordict.nn
import torch.compiler
before = "torch._dynamo" in sys.modules
restored = [f.__module__ for f in (torch.compiler.allow_in_graph, torch.compiler.assume_constant_result)]
import torch._dynamo
from torch._dynamo import trace_rules

seen, out = set(), {}
def visit(where, value):
    if not callable(value) or id(value) in seen:
        return
    seen.add(id(value))
    try:
        rule = trace_rules.lookup_callable(value)
    except Exception as e:  # not a function dynamo can look up
        rule = type(e).__name__
    out[where] = [getattr(rule, "__name__", str(rule)), bool(getattr(value, "_dynamo_marked_constant", False))]

for name, module in sorted(sys.modules.items()):
    if name.split(".")[0] != "tensordict" or module is None:
        continue
    for attr, value in list(vars(module).items()):
        visit(f"{name}.{attr}", value)
        if isinstance(value, type) and value.__module__.startswith("tensordict"):
            for member, inner in list(vars(value).items()):
                visit(f"{name}.{attr}.{member}", getattr(inner, "__func__", inner))
print(json.dumps({"dynamo_before": before, "restored": restored, "callables": out}))
"""


def _scan(defer: bool) -> dict:
    env = {**os.environ, "SHOAL_DEFER_DYNAMO": "1" if defer else "0"}
    result = subprocess.run([sys.executable, "-c", _SCAN], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_deferred_tensordict_import_leaves_dynamo_as_a_plain_import_does():
    deferred, plain = _scan(True), _scan(False)
    assert deferred["dynamo_before"] is False and plain["dynamo_before"] is True
    assert deferred["restored"] == ["torch.compiler", "torch.compiler"]  # torch's own functions are back
    allowed = {k for k, (rule, _) in plain["callables"].items() if rule == "TorchInGraphFunctionVariable"}
    marked = {k for k, (_, constant) in plain["callables"].items() if constant}
    assert allowed and marked  # tensordict does mark functions: otherwise there would be nothing to compare
    assert deferred["callables"] == plain["callables"]


def test_a_rollout_workers_modules_import_neither_dynamo_nor_torchrl():
    code = ("import sys, orchestration.ray_fleet, adapters.env_worker\n"
            "print(sorted(m for m in ('torch._dynamo', 'torchrl') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_a_function_marked_before_dynamo_loads_is_registered_when_it_does_and_a_bad_one_only_warns():
    """The replay itself, in a fresh process: marked while the stand-ins are in place, registered when
    ``torch._dynamo`` is imported; one that dynamo refuses leaves the import working and the others registered."""
    code = """
import sys, warnings
import core
from core import dynamo_deferral as d
import tensordict
assert "torch._dynamo" not in sys.modules
def mine(x):
    return x + 1
class Refused:  # no weak reference to it: dynamo's allow_in_graph raises TypeError
    __slots__ = ()
    def __call__(self, x):
        return x
d._patch()
import torch.compiler
refused = Refused()
assert torch.compiler.allow_in_graph(refused) is refused and torch.compiler.allow_in_graph(mine) is mine
d._unpatch(None, True)
assert mine in d.deferred()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch._dynamo
from torch._dynamo import trace_rules
print(trace_rules.lookup_callable(mine).__name__, d.deferred(), [str(w.message)[:80] for w in caught])
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rule, pending, caught = result.stdout.strip().rsplit("\n", 1)[-1].split(" ", 2)
    assert rule == "TorchInGraphFunctionVariable" and pending == "[]", result.stdout
    assert "core.dynamo_deferral: torch._dynamo.allow_in_graph(<__main__.Refused" in caught, caught
