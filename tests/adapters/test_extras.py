"""Optional environment families: a missing package is named with the extra that installs it.

The packages are made unimportable the way a fresh ``pip install shoal`` lacks them: a ``None`` entry in
``sys.modules`` (``import`` then raises ``ModuleNotFoundError``), with the env modules that import them
dropped from the cache so that they import again. ``monkeypatch`` puts everything back after each test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adapters.extras import EXTRAS, MissingExtra, extra_for, is_installed, require
from orchestration.envs import make_env

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("mpe2", "pygame", "pymunk", "vmas", "Box2D")
"""Top-level modules of the optional environment families."""


def _block(monkeypatch, *modules: str, drop: tuple[str, ...] = ()) -> None:
    """Makes ``modules`` (and their submodules) unimportable and forgets every cached module whose name
    starts with one in ``drop`` (``pettingzoo.classic.connect_four``: the game and its ``_v3`` module)."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules) or name.startswith(drop):
            monkeypatch.delitem(sys.modules, name)
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def _one_paragraph(err: pytest.ExceptionInfo, extra: str) -> str:
    message = str(err.value)
    assert f"pip install 'shoal[{extra}]'" in message, message
    assert "\n" not in message
    return message


@pytest.mark.parametrize("env, blocked, drop, extra", [
    ("mpe2:simple_spread_v3", "mpe2", (), "mpe2"),
    ("mpe2:simple_spread_v3", "pygame", ("mpe2",), "mpe2"),  # mpe2 is there, its pygame is not
    ("pettingzoo:classic.connect_four_v3", "pygame", ("pettingzoo.classic.connect_four",), "classic"),
    ("pettingzoo:butterfly.pistonball_v6", "pymunk", ("pettingzoo.butterfly.pistonball",), "butterfly"),
    ("vmas:navigation", "vmas", (), "vmas"),
    ("LunarLander-v3", "Box2D", ("gymnasium.envs.box2d",), "box2d"),
])
def test_a_missing_family_names_its_extra(monkeypatch, env, blocked, drop, extra):
    _block(monkeypatch, blocked, drop=drop)
    with pytest.raises(MissingExtra) as err:
        make_env(env, 1)
    message = _one_paragraph(err, extra)
    assert repr(env) in message and repr(blocked) in message
    assert isinstance(err.value, ImportError)  # the CLI reports ImportErrors as user errors (exit status 2)


def test_pettingzoo_mpe_points_to_mpe2_and_its_extra(monkeypatch):
    _block(monkeypatch, "mpe2")
    with pytest.raises(ValueError, match=r"mpe2:simple_spread_v3 \(after pip install 'shoal\[mpe2\]'\)"):
        make_env("pettingzoo:mpe.simple_spread_v3", 1)


def test_unknown_names_stay_name_errors():
    pytest.importorskip("mpe2")
    with pytest.raises(ValueError, match="mpe2 ids are mpe2:<name>"):
        make_env("mpe2:no_such_env_v0", 1)
    with pytest.raises(ValueError, match="PettingZoo ids are"):
        make_env("pettingzoo:classic.no_such_game_v0", 1)


def test_a_misspelled_env_id_names_the_nearest_one():
    pytest.importorskip("mpe2")
    with pytest.raises(ValueError, match=r"did you mean 'mpe2:simple_spread_v3'\?"):
        make_env("mpe2:simple_sprad_v3", 1)
    with pytest.raises(ValueError, match=r"did you mean 'pettingzoo:classic\.connect_four_v3'\?"):
        make_env("pettingzoo:clasic.connect_four_v3", 1)
    pytest.importorskip("vmas")
    with pytest.raises(ValueError, match=r"unknown VMAS scenario 'navigaton' \(did you mean 'navigation'\?\)"):
        make_env("vmas:navigaton", 1)  # VMAS itself fails an assert, which the CLI would show as a traceback
    with pytest.raises(ValueError, match=r"unknown VMAS scenario '.*my_scenario\.py'"):
        make_env(f"vmas:{__file__.replace('test_extras', 'my_scenario')}", 1)  # VMAS reads its own folder only


def test_the_cli_prints_one_paragraph_and_exits_2(monkeypatch, tmp_path, capsys):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    _block(monkeypatch, "mpe2")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "mpe2:simple_spread_v3", "--iterations", "1", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal train: env 'mpe2:simple_spread_v3' needs the optional package 'mpe2'"), err
    assert "pip install 'shoal[mpe2]'" in err and "Traceback" not in err and "\n" not in err


def test_helpers(monkeypatch):
    assert extra_for("pygame", "mpe2") == "mpe2" and extra_for("pygame", "classic") == "classic"
    assert extra_for("pygame.freetype") == "classic" and extra_for("numpy") is None
    assert is_installed("torch") and not is_installed("no_such_module_anywhere")
    monkeypatch.setitem(sys.modules, "vmas", None)
    assert not is_installed("vmas")
    with pytest.raises(MissingExtra, match=r"pip install 'shoal\[vmas\]'"):
        require("vmas:navigation", "vmas")


def test_pyproject_declares_every_extra_and_dev_installs_what_tests_build():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = {*EXTRAS.values(), "mpe2", "classic", "butterfly"}
    assert named <= set(extras), named - set(extras)
    everything = extras["all"][0]
    assert all(e in everything for e in named), everything
    required = " ".join(project["dependencies"])
    for package in ("mpe2", "pygame", "pymunk", "vmas", "box2d"):
        assert package not in required.lower(), f"{package} should be optional"
    dev = " ".join(extras["dev"])
    assert all(p in dev for p in ("mpe2", "pygame-ce", "pymunk", "vmas")), dev


@pytest.mark.slow
def test_training_needs_no_optional_package(tmp_path):
    code = ("import sys\n"
            f"for m in {OPTIONAL!r}: sys.modules[m] = None\n"
            "from orchestration.cli import main\n"
            "main(['train', 'CartPole-v1', '--iterations', '1', '--rollout.num-envs', '2', '--rollout.fragment-length',"
            " '8', '--no-progress', '--run-dir', 'run'])\n"
            "main(['train', 'builtin:spread', '--iterations', '1', '--rollout.num-envs', '2', '--rollout.fragment-length',"
            " '8', '--no-progress', '--run-dir', 'spread'])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
