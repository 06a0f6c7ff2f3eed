"""Checkpoints without pickle: tensors in safetensors files, everything else in plain JSON.

Layout of a checkpoint directory ``ROOT``::

    ROOT/latest                    name of the newest complete checkpoint (replaced atomically)
    ROOT/ckpt-000042/weights.safetensors   policy parameters, keys "<policy>/<param name>"
    ROOT/ckpt-000042/state.safetensors     optimizer moments, RNG states, other tensors
    ROOT/ckpt-000042/state.json            counters, configs, the tree, optimizer hyper-parameters

A checkpoint is written into a temporary directory, flushed, then renamed into place, and only then does
``latest`` point at it: a crash mid-write leaves the previous checkpoint valid and ``latest`` unchanged.
Loading reads safetensors and JSON only, so a checkpoint from an untrusted source cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"
_PREFIX = "ckpt-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    # safetensors refuses shared or non-contiguous storage: give it private contiguous copies.
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _parse(name: str) -> tuple[int, int] | None:
    """``ckpt-000042`` -> (42, 0), ``ckpt-000042.3`` -> (42, 3); None for anything else."""
    if not name.startswith(_PREFIX):
        return None
    step, _, again = name[len(_PREFIX):].partition(".")
    if not step.isdigit() or (again and not again.isdigit()):
        return None
    return int(step), int(again or 0)


def _checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first (by step, then by re-save)."""
    found = [(key, p) for p in root.iterdir() if (key := _parse(p.name)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_at(root: str | Path, step: int) -> Path:
    """The newest complete checkpoint of ``step`` under ``root`` (a re-save ``ckpt-000042.1`` over the first):
    several checkpoint roots saved together (a league's players) resume from one step.

    Raises:
        FileNotFoundError: no complete checkpoint of that step; the message names the steps there are.
    """
    root = Path(root)
    found = [p for p in _checkpoints(root) if _parse(p.name)[0] == step and _complete(p)] if root.is_dir() else []
    if not found:
        steps = sorted({_parse(p.name)[0] for p in _checkpoints(root)}) if root.is_dir() else []
        raise FileNotFoundError(f"no complete checkpoint of step {step} under {root} (steps there: {steps})")
    return found[-1]


def clean_stale(root: str | Path) -> int:
    """Removes half-written ``.tmp-*`` directories and pointer files a killed writer left; returns how many."""
    root = Path(root)
    if not root.is_dir():
        return 0
    stale = [p for p in root.iterdir() if p.name.startswith((".tmp-", f".{LATEST}.tmp"))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return len(stale)


def save_checkpoint(root: str | Path, step: int, *, weights: dict[str, torch.Tensor],
                    tensors: dict[str, torch.Tensor], state: dict[str, Any], keep: int = 3) -> Path:
    """Writes checkpoint ``step`` under ``root`` atomically and points ``latest`` at it.

    Order: write a temporary directory, fsync it, rename it into place under a name no checkpoint has
    (saving an existing step again makes ``ckpt-000042.1``), fsync ``root``, replace the ``latest`` pointer,
    fsync ``root``; only then remove older checkpoints. A kill at any point leaves ``latest`` pointing at a
    complete checkpoint (the new one or the previous one); nothing ``latest`` names is removed before its
    replacement is durable.

    Args:
        root: the checkpoint directory (created if needed).
        step: a monotonically increasing number (the training iteration).
        weights: policy parameters, flat ``"policy/param"`` keys.
        tensors: any other tensors (optimizer moments, RNG states).
        state: JSON-able counters and configs.
        keep: how many complete checkpoints to keep (older ones are removed after the new one is in place); 0:
            every one.

    Returns:
        The directory of the new checkpoint.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name, again = f"{_PREFIX}{step:06d}", 0
    while (root / name).exists():
        again += 1
        name = f"{_PREFIX}{step:06d}.{again}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _save_tensors(tmp / "weights.safetensors", weights)
        _save_tensors(tmp / "state.safetensors", tensors)
        _write_json(tmp / "state.json", state)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(final.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in _checkpoints(root)[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(directory: Path) -> bool:
    return not _missing(directory)


def _missing(directory: Path) -> list[str]:
    return [f for f in ("weights.safetensors", "state.safetensors", "state.json") if not (directory / f).is_file()]


def resolve(path: str | Path) -> Path:
    """The checkpoint directory that ``path`` names: a checkpoint itself, a root with ``latest``, or a run directory
    (its ``checkpoints`` root).

    When ``latest`` is missing or names an incomplete checkpoint (a crash mid-write), the newest complete
    checkpoint under the root is used instead, with a warning.

    Raises:
        FileNotFoundError: no complete checkpoint there; the message says what was looked for.
    """
    path = Path(path)
    if (path / "state.json").exists():
        return path
    named = (path / LATEST).read_text().strip() if (path / LATEST).is_file() else None
    if named is not None and _parse(named) is not None and _complete(path / named):
        return path / named
    complete = [p for p in _checkpoints(path) if _complete(p)] if path.is_dir() else []
    if complete:
        warnings.warn(f"checkpoint pointer {path / LATEST} is {'missing' if named is None else 'stale'}; "
                      f"using the newest complete checkpoint, {complete[-1].name}", RuntimeWarning, stacklevel=2)
        return complete[-1]
    if (path / "checkpoints").is_dir():  # a run's directory, named instead of its checkpoints
        return resolve(path / "checkpoints")
    base = path.parent if path.name == "checkpoints" else path  # the directory of a --seeds run holds runs
    seeds = sorted(p.name for p in base.glob("seed_*") if (p / "checkpoints").is_dir()) if base.is_dir() else []
    runs = f"; {base} holds the runs of --seeds ({', '.join(seeds)}): name one, e.g. {base / seeds[0]}" if seeds else ""
    runs = runs or league_players_hint(path)
    if not runs and (cut := _checkpoints(path) if path.is_dir() else []):  # only incomplete ones: say what they lack
        runs = (f"; its newest, {cut[-1].name}, lacks {', '.join(_missing(cut[-1]))} (a write cut short, or files "
                f"removed)")
    raise FileNotFoundError(f"no checkpoint at {path}: neither a checkpoint directory (state.json) nor a "
                            f"checkpoint root with complete '{_PREFIX}*' directories{runs}")


def league_players_hint(path: str | Path) -> str:
    """``"; RUN is a league: ..."`` naming its players' checkpoints when ``path`` is in a ``shoal league`` run
    (its directory, or its ``league/``), else ``""``."""
    path = Path(path).absolute()
    for run in (path, *path.parents)[:4]:
        players = sorted(p.name for p in (run / "players").glob("*") if (p / "checkpoints").is_dir())
        if players and (run / "league").is_dir():
            example = next((name for name in players if name.startswith("main_")), players[0])
            snapshot = (" (a snapshot of league/pool/ plays only as an --opponent)"
                        if (path / "snapshot.json").is_file() else "")
            return (f"; {run} is a league: each player's checkpoints are under players/ ({', '.join(players)}), "
                    f"e.g. {run / 'players' / example / 'checkpoints'}{snapshot}")
    return ""


MAX_JSON_BYTES = 64 << 20
"""state.json larger than this is refused (a real one is a few hundred KB)."""


class CheckpointError(ValueError):
    """A checkpoint that is refused: the message names the file or tensor and what is wrong with it."""


def _check_files(directory: Path) -> None:
    if directory.is_symlink():
        raise CheckpointError(f"{directory} is a symbolic link; copy the checkpoint instead of linking it")
    for name in ("weights.safetensors", "state.safetensors", "state.json"):
        file = directory / name
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"{file} is {'a symbolic link' if file.is_symlink() else 'missing'}: "
                                  f"a checkpoint holds three plain files")
    if (directory / "state.json").stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{directory / 'state.json'} is larger than {MAX_JSON_BYTES >> 20} MiB")


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"state.json: {where} must be {what}")


def _is_int(x: Any, low: int = 0) -> bool:  # and below 2**62: counters are stored in int64 tensors
    return isinstance(x, int) and not isinstance(x, bool) and low <= x < 2 ** 62


def validate_state(state: Any) -> None:
    """Checks the types and ranges of a checkpoint's ``state.json`` (what resuming and evaluating read).

    Raises:
        CheckpointError: naming the first field that is wrong.
    """
    _expect(isinstance(state, dict), "the document", "a JSON object")
    _expect(isinstance(state.get("config"), dict), "'config'", "an object (the run's TrainConfig)")
    for section in ("rollout", "ppo", "policy", "ray", "external", "curiosity", "pretrain", "past_selves",
                    "team_critic"):  # the TrainConfig records: objects (absent ones are an older run's defaults)
        _expect(isinstance(state["config"].get(section, {}), dict), f"'config.{section}'", "an object")
    _expect(isinstance(state.get("config", {}).get("env"), str), "'config.env'", "a string")
    _expect(isinstance(state.get("tree"), str), "'tree'", "a string (the env's tree as JSON)")
    for key in ("iteration", "env_steps"):
        _expect(_is_int(state.get(key)), f"'{key}'", "an integer in [0, 2**62)")
    _expect(_is_int(state.get("episodes_total", 0)), "'episodes_total'", "an integer in [0, 2**62)")  # older runs: none
    history = state.get("history", {})
    _expect(isinstance(history, dict) and all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
                                              for v in history.values()), "'history'", "an object of number lists")
    agents = state.get("agent_history", {})
    _expect(isinstance(agents, dict) and all(isinstance(rows, list) and all(
        isinstance(r, list) and all(isinstance(x, (int, float)) for x in r) for r in rows) for rows in agents.values()),
        "'agent_history'", "an object of lists of number lists")
    learners = state.get("learners")
    _expect(isinstance(learners, dict) and bool(learners), "'learners'", "a non-empty object")
    for pid, entry in learners.items():
        _expect(isinstance(entry, dict) and _is_int(entry.get("version")), f"'learners.{pid}.version'",
                "an integer in [0, 2**62)")
    _expect(isinstance(state.get("actors", []), list), "'actors'", "a list")


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Reads ``(weights, tensors, state)`` from a checkpoint or a root directory (its ``latest``).

    Reads safetensors and JSON only, so an untrusted checkpoint cannot run code here; its files are checked
    (no symbolic links, bounded JSON), its JSON against :func:`validate_state`, and every floating-point
    tensor must be finite.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        CheckpointError: a refused checkpoint, naming the file, field or tensor at fault.
    """
    directory = resolve(path)
    _check_files(directory)
    try:
        weights = load_file(str(directory / "weights.safetensors"))
        tensors = load_file(str(directory / "state.safetensors"))
    except Exception as err:  # safetensors' own header checks: a truncated or crafted file
        raise CheckpointError(f"{directory}: unreadable tensors ({err})") from err
    try:
        with open(directory / "state.json") as f:
            state = json.load(f)
    except (ValueError, RecursionError) as err:  # RecursionError: arrays nested deeper than Python's stack
        raise CheckpointError(f"{directory / 'state.json'}: not valid JSON ({type(err).__name__}: {err})") from None
    validate_state(state)
    for kind, table in (("weight", weights), ("state tensor", tensors)):
        for name, tensor in table.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"{directory}: {kind} {name!r} holds NaN or Inf values")
    unknown = sorted({k.split("/", 1)[0] for k in weights} - set(state["learners"]))
    if unknown:
        raise CheckpointError(f"{directory}: weights of policies {unknown} that state.json does not list")
    return weights, tensors, state


def flatten_optimizer(prefix: str, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Splits an optimizer state dict into tensors (``prefix/state/<i>/<name>``) and JSON (the rest)."""
    sd = optimizer.state_dict()
    tensors, json_state = {}, {}
    for idx, entry in sd["state"].items():
        json_state[str(idx)] = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}/state/{idx}/{name}"] = value
            else:
                json_state[str(idx)][name] = value
    return tensors, {"state": json_state, "param_groups": sd["param_groups"]}


def restore_optimizer(prefix: str, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                      meta: dict) -> None:
    """Inverse of :func:`flatten_optimizer`: loads the state into ``optimizer``.

    Raises:
        ValueError: a state that does not fit ``optimizer``'s parameters (a moment of another shape: torch's
            fused Adam would write past the parameter's memory), or malformed metadata; naming ``prefix``.
    """
    try:
        state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in meta["state"].items()}
        head = f"{prefix}/state/"
        for key, value in tensors.items():
            if key.startswith(head):
                idx, name = key[len(head):].split("/", 1)
                state.setdefault(int(idx), {})[name] = value
        groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
        params = {int(i): p for saved, group in zip(groups, optimizer.param_groups)
                  for i, p in zip(saved["params"], group["params"])}
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{prefix}: the checkpoint's optimizer state is malformed ({type(err).__name__}: {err})") \
            from None
    for idx, entries in state.items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() and (idx not in params or
                                                                    value.shape != params[idx].shape):
                want = tuple(params[idx].shape) if idx in params else "no parameter"
                raise ValueError(f"{prefix}: the checkpoint's optimizer state {name!r} of parameter {idx} has shape "
                                 f"{tuple(value.shape)}, the parameter {want}: it is another network's")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


__all__ = ["CheckpointError", "checkpoint_at", "clean_stale", "flatten_optimizer", "load_checkpoint", "resolve", "restore_optimizer", "save_checkpoint",
           "validate_state"]
