"""The documentation runs: every page's code, the tour in ``examples/``, and the links of the README and docs.

Each page of ``docs/`` is played top to bottom in a fresh directory, the way a reader would type it:

- a fenced block with ``title="NAME"`` (a module, a YAML file) is written to ``NAME``;
- other ``python`` blocks are executed, in one namespace per page;
- in ``bash`` blocks, every command that starts with ``shoal `` (or ``PYTHONPATH=. shoal ``) runs
  through :func:`orchestration.cli.main` in this process; other lines (``pip install``, ``ray start``,
  ``RAY_ADDRESS=auto shoal ...`` on a cluster) are for the reader only.

Budgets shrink so the whole file stays near a minute: every iteration count on a page (``--iterations N``,
``iterations=N``, ``iterations: N``) becomes 1, and ``shoal train`` and ``shoal league`` get ``--no-progress``.
Nothing else is rewritten: flags, env ids and Python calls run as documented. What the pages say the full budgets reach
(returns, times) was measured by hand; ``test_tour_learns`` asserts the tour's learning.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN_HERE = {"ray.md": "needs the session's Ray instance: test_ray_page_runs",
                "external-protocol.md": "a reference whose commands launch simulators; tests/adapters/"
                                        "test_external_conformance.py and tests/orchestration/test_external_*.py",
                "CONTRIBUTING.md": "commands for working on Shoal (the test suite itself)"}
TUTORIALS = sorted(p.name for p in DOCS.glob("*.md") if p.name not in NOT_RUN_HERE)
"""Pages run by :func:`test_page_runs`: every page of docs/ but those above (new pages are run too)."""
SLOW = {"mappo.md"}
"""Pages that train several multi-agent runs (VMAS, mpe2): about 10 s."""

_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r'title="([^"]+)"')
_ITERATIONS = re.compile(r"(--iterations[ =]|\biterations\s*[:=]\s*)(\d+)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def shrink(code: str) -> str:
    """``code`` with every iteration count replaced by 1."""
    return _ITERATIONS.sub(lambda m: f"{m.group(1)}1", code)


def blocks(page: Path) -> list[tuple[str, str | None, str]]:
    """``(language, title or None, code)`` of every fenced block of ``page``, in order (untitled code is
    preceded by blank lines, so that line numbers are the page's)."""
    text, out = page.read_text(), []
    for match in _FENCE.finditer(text):
        lang, info, code = match.groups()
        title = _TITLE.search(info)
        line = text.count("\n", 0, match.start(3))  # padded: tracebacks give the page's line numbers
        out.append((lang, title.group(1) if title else None, code if title else "\n" * line + code))
    return out


def shoal_commands(script: str) -> list[list[str]]:
    """The ``shoal`` commands of a bash block, as argument lists without the leading ``shoal``."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["PYTHONPATH=."]:
            words = words[1:]
        if words[:1] == ["shoal"]:
            commands.append(words[1:])
    return commands


def run_page(name: str, directory: Path, monkeypatch) -> dict:
    """Plays page ``docs/<name>`` in ``directory`` (see the module docstring); returns its Python namespace."""
    from orchestration.cli import main

    monkeypatch.chdir(directory)
    monkeypatch.syspath_prepend(str(directory))  # what PYTHONPATH=. does for `shoal` on the page
    namespace: dict = {"__name__": f"docs.{name}"}
    for _, title, _ in blocks(DOCS / name):  # another test's module of the same name (my_envs) is not the page's
        if title is not None and title.endswith(".py"):
            monkeypatch.delitem(sys.modules, title[:-3], raising=False)
    try:
        for lang, title, code in blocks(DOCS / name):
            code = shrink(code)
            if title is not None:
                (directory / title).write_text(code)
            elif lang == "python":
                exec(compile(code, f"docs/{name}", "exec"), namespace)
            elif lang == "bash":
                for argv in shoal_commands(code):
                    main([*argv, "--no-progress"] if argv[0] in ("train", "league") else argv)
    finally:  # modules the page wrote (my_envs.py) must not leak into other tests
        for key, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(directory)):
                del sys.modules[key]
    return namespace


def test_shrink_and_commands():
    assert shrink("shoal train X --iterations 100 --seed 3") == "shoal train X --iterations 1 --seed 3"
    assert shrink("TrainConfig(iterations=30)\niterations: 60") == "TrainConfig(iterations=1)\niterations: 1"
    script = "pip install -e .\nshoal train A \\\n  --iterations 4  # comment\nRAY_ADDRESS=auto shoal train B\n" \
             "PYTHONPATH=. shoal train c:d"
    assert shoal_commands(script) == [["train", "A", "--iterations", "4"], ["train", "c:d"]]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in TUTORIALS])
def test_page_runs(name, tmp_path, monkeypatch):
    ran = [b for b in blocks(DOCS / name) if b[0] == "python" or shoal_commands(b[2])]
    assert ran, f"docs/{name} has no code to run"
    run_page(name, tmp_path, monkeypatch)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_page_runs(ray_session, tmp_path, monkeypatch):
    run_page("ray.md", tmp_path, monkeypatch)


def test_tour_learns():
    spec = importlib.util.spec_from_file_location("shoal_tour", ROOT / "examples" / "tour.py")
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    curve = tour.tour(iterations=12, seed=0)
    assert len(curve) == 12
    first, last = curve[0], [r for r in curve[-3:] if not math.isnan(r)]
    assert last and min(last) > 2 * first, curve  # ~20 -> well above 100 with this seed


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not links inside code
    return [target.split("#")[0] for target in _LINK.findall(text)]


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))])
def test_links_resolve_inside_the_repository(page):
    path = ROOT / page
    for target in _links(path):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:") or not target:
            assert page != "README.md", f"README.md links outside the repository: {target}"
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{page} links outside the repository: {target}"
        assert resolved.exists(), f"{page} links a missing file: {target}"


def test_readme_links_the_docs_and_nothing_outside():
    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text
    assert "docs/index.md" in _links(ROOT / "README.md")


def test_mkdocs_nav_lists_every_page():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (pages(value) if isinstance(value, list) else [value])

    listed = set(pages(config["nav"]))
    assert listed == {p.name for p in DOCS.glob("*.md")}
