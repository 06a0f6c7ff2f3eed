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


def save_checkpoint(root: str | Path, step: int, *, weights: dict[str, torch.Tensor],
                    tensors: dict[str, torch.Tensor], state: dict[str, Any], keep: int = 3) -> Path:
    """Writes checkpoint ``step`` under ``root`` atomically and points ``latest`` at it.

    Args:
        root: the checkpoint directory (created if needed).
        step: a monotonically increasing number (the training iteration).
        weights: policy parameters, flat ``"policy/param"`` keys.
        tensors: any other tensors (optimizer moments, RNG states).
        state: JSON-able counters and configs.
        keep: how many complete checkpoints to keep (older ones are removed after the new one is in place).

    Returns:
        The directory of the new checkpoint.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _save_tensors(tmp / "weights.safetensors", weights)
        _save_tensors(tmp / "state.safetensors", tensors)
        _write_json(tmp / "state.json", state)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(path: str | Path) -> Path:
    """The checkpoint directory that ``path`` names: a checkpoint itself, or a root with ``latest``."""
    path = Path(path)
    if (path / "state.json").exists():
        return path
    if (path / LATEST).exists():
        return path / (path / LATEST).read_text().strip()
    raise FileNotFoundError(f"no checkpoint at {path} (neither state.json nor a '{LATEST}' pointer)")


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Reads ``(weights, tensors, state)`` from a checkpoint or a root directory (its ``latest``)."""
    directory = resolve(path)
    weights = load_file(str(directory / "weights.safetensors"))
    tensors = load_file(str(directory / "state.safetensors"))
    with open(directory / "state.json") as f:
        state = json.load(f)
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
    """Inverse of :func:`flatten_optimizer`: loads the state into ``optimizer``."""
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in meta["state"].items()}
    head = f"{prefix}/state/"
    for key, value in tensors.items():
        if key.startswith(head):
            idx, name = key[len(head):].split("/", 1)
            state.setdefault(int(idx), {})[name] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


__all__ = ["flatten_optimizer", "load_checkpoint", "resolve", "restore_optimizer", "save_checkpoint"]
