"""Policy snapshots (seed 002 leagues): one frozen policy, independent of training checkpoints, that any actor
or process loads: its weights, the tree it acts in, its group, version and architecture.

A snapshot is a directory of two plain files (no pickle; loading never runs code)::

    SNAP/weights.safetensors   the policy's parameters and buffers (TensorDict.from_module keys, "." joined)
    SNAP/snapshot.json         {"format": "shoal.snapshot/1", "policy", "group", "version", "tree" (JSON),
                                "policy_config" (the PolicyConfig fields), "rating" (a league's, when saved)}

Usage::

    save_snapshot("pool/player@12", policy, tree, group="player", policy_id="player", version=12, config=cfg)
    snapshot = load_snapshot("pool/player@12")     # in any process
    snapshot.policy.act_step(obs, ...)             # the same actions as the saved module
    trainer.set_weights("opponent", snapshot.weights())
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tensordict import TensorDict, TensorDictBase

from core.policies import GroupPolicy, PolicyConfig, make_policies
from core.policies.config import policy_config_from_dict
from core.specs import Tree, from_json, groups, to_json
from orchestration.checkpoint import CheckpointError

FORMAT = "shoal.snapshot/1"
_MAX_JSON = 16 << 20


@dataclass(frozen=True)
class Snapshot:
    """A loaded snapshot: the module (eval mode, CPU) and what describes it."""

    policy: GroupPolicy
    policy_id: str
    group: str
    version: int
    tree: Tree
    rating: float | None = None
    """Its Elo rating in the league that saved it (:class:`orchestration.league.Member`), if one did."""

    def weights(self) -> TensorDictBase:
        """The weights as :meth:`orchestration.trainer.Trainer.set_weights` takes them."""
        return TensorDict.from_module(self.policy).detach().clone()


def save_snapshot(path: str | Path, policy: GroupPolicy, tree: Tree, *, group: str, policy_id: str, version: int,
                  config: PolicyConfig, rating: float | None = None) -> Path:
    """Writes ``policy`` as a snapshot directory at ``path`` (atomically: a temporary directory renamed), with
    its league ``rating`` (:attr:`Snapshot.rating`) if given."""
    if group not in groups(tree):
        raise ValueError(f"group {group!r} is not in the tree; its groups are {sorted(groups(tree))}")
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: a snapshot is written once (give each version its own name)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tensors = {".".join(k) if isinstance(k, tuple) else k: v.detach().cpu().contiguous().clone()
               for k, v in TensorDict.from_module(policy).items(True, True)}
    save_file(tensors, str(tmp / "weights.safetensors"))
    meta = {"format": FORMAT, "policy": policy_id, "group": group, "version": int(version), "tree": to_json(tree),
            "policy_config": json.loads(json.dumps(dataclasses.asdict(config)))}
    if rating is not None:
        meta["rating"] = float(rating)
    (tmp / "snapshot.json").write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path)
    return path


def load_snapshot(path: str | Path) -> Snapshot:
    """Reads a snapshot written by :func:`save_snapshot`.

    Raises:
        CheckpointError: a refused snapshot (a symbolic link, a missing file, another format, weights that do
            not fit the architecture it declares, non-finite values), naming the file or entry at fault.
    """
    path = Path(path)
    for file in (path, path / "weights.safetensors", path / "snapshot.json"):
        if file.is_symlink() or not file.exists():
            raise CheckpointError(f"{file} is {'a symbolic link' if file.is_symlink() else 'missing'}: a snapshot "
                                  f"is a directory of two plain files")
    if (path / "snapshot.json").stat().st_size > _MAX_JSON:
        raise CheckpointError(f"{path / 'snapshot.json'} is larger than {_MAX_JSON >> 20} MiB")
    try:
        meta = json.loads((path / "snapshot.json").read_text())
        tensors = load_file(str(path / "weights.safetensors"))
    except Exception as error:  # noqa: BLE001 - malformed JSON or a crafted tensor file
        raise CheckpointError(f"{path}: unreadable snapshot ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / 'snapshot.json'}: format must be {FORMAT!r}")
    for key, kind in (("policy", str), ("group", str), ("version", int), ("tree", str), ("policy_config", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{path / 'snapshot.json'}: {key!r} must be a {kind.__name__}")
    rating = meta.get("rating")
    if rating is not None and not (type(rating) is float and math.isfinite(rating)):  # nor an int of any size
        raise CheckpointError(f"{path / 'snapshot.json'}: 'rating' must be a finite number")
    tree = from_json(meta["tree"])
    policy = make_policies(tree, policy_config_from_dict(meta["policy_config"]))[meta["group"]]
    target = TensorDict.from_module(policy)
    expected = {".".join(k) if isinstance(k, tuple) else k for k in target.keys(True, True)}
    if set(tensors) != expected:
        raise CheckpointError(f"{path}: weights {sorted(set(tensors) ^ expected)[:4]} do not fit the declared policy")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: weight {name!r} holds NaN or Inf values")
    with torch.no_grad():
        target.update_({tuple(k.split(".")): v for k, v in tensors.items()})
    return Snapshot(policy.eval(), meta["policy"], meta["group"], meta["version"], tree, rating)


__all__ = ["Snapshot", "load_snapshot", "save_snapshot"]
