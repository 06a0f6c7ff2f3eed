"""The dependency rule, checked two ways: statically (AST scan) and dynamically (Ray made unimportable)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE_FORBIDDEN = {"ray", "gymnasium", "gym", "pettingzoo", "mpe2", "vmas", "orchestration", "adapters", "socket",
                  "websockets", "msgpack", "subprocess", "multiprocessing"}


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_only_torch_tensordict_torchrl():
    files = list((ROOT / "core").rglob("*.py"))
    assert files
    for path in files:
        bad = _imports(path) & CORE_FORBIDDEN
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_ray_only_in_orchestration_modules_named_for_it():
    for package in ("core", "adapters", "orchestration"):
        for path in (ROOT / package).rglob("*.py"):
            if "ray" in _imports(path):
                assert package == "orchestration" and path.name.startswith("ray_"), \
                    f"{path.relative_to(ROOT)} imports ray"


def test_core_imports_with_ray_unimportable():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "core").rglob("*.py"))
    modules = [m.removesuffix(".__init__") for m in modules]
    code = "import sys; sys.modules['ray'] = None\n" + "\n".join(f"import {m}" for m in modules)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_tensordict_private_api_only_in_its_quarantine_module():
    private = {"_tensordict", "_get_str", "_new_unsafe", "_batch_size", "_td_dim_names"}
    allowed = ROOT / "core" / "tensordicts.py"
    for package in ("core", "adapters", "orchestration"):
        for path in (ROOT / package).rglob("*.py"):
            if path == allowed:
                continue
            used = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)} & private
            assert not used, f"{path.relative_to(ROOT)} reads tensordict's private {sorted(used)}: use core.tensordicts"
