"""Trajectory datasets (recorded human play, a scripted or trained policy): save, load, record; no pickle.

A dataset is a directory of two plain files (loading never runs code; the format is in docs/datasets.md)::

    DATA/tensors.safetensors   every tensor, its nested key joined with "." (e.g. "agent.observation")
    DATA/dataset.json          {"format": "shoal.dataset/1", "env", "tree" (core.specs.to_json), "episodes",
                                "steps", "source"}

In memory (:class:`Dataset`) the data is one TensorDict of ``N`` transitions, whole episodes laid end to end
in the layout of :mod:`core.layout` (root ``[N]``, groups ``[N, A]``), with the episode number at
``"episode_id"`` ``[N]`` instead of fragment metadata. Usage::

    data = record_dataset(scripted, "builtin:cartpole", episodes=20, seed=0)   # a callable or GroupPolicy
    save_dataset("datasets/cartpole-scripted", data)
    data = load_dataset("datasets/cartpole-scripted")  # DatasetError names the file and key at fault
    data.episode_returns()                               # [episodes] float64
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import load_file, save_file
from tensordict import TensorDict, TensorDictBase

from core.layout import (ACTION, ACTION_MASK, DONE, EPISODE_ID, LOG_PROB, MASK, NEXT, OBSERVATION, REWARD, SHARED,
                         TERMINATED, TRUNCATED)
from core.specs import SpecViolation, Tree, TreeError, from_json, groups, iter_leaves, shared_observations, to_json
from core.specs import validate as validate_tree

FORMAT = "shoal.dataset/1"
TENSORS, HEADER = "tensors.safetensors", "dataset.json"
_MAX_JSON = 16 << 20
_HEADER_TYPES = {"format": str, "env": str, "tree": str, "episodes": int, "steps": int, "source": str}

Act = Callable[[TensorDictBase], Mapping[str, Mapping[str, Any]]]
"""``act(step) -> {group: {"action": [E, A, *act] (or a tree), optional "log_prob": [E, A, 1]}}`` for one
protocol step ``[E]`` (a scripted controller, a human's input, a wrapped policy)."""


class DatasetError(ValueError):
    """A dataset refused on saving or loading; ``file`` and ``key`` (dotted, or None) name what is at fault."""

    def __init__(self, file: str | Path, message: str, *, key: str | None = None) -> None:
        super().__init__(f"{file}{f' [{key}]' if key else ''}: {message}")
        self.file, self.key = str(file), key


@dataclass(frozen=True)
class Dataset:
    """Recorded episodes: ``data`` ``[N]`` transitions (module docstring), the tree they follow, their env."""

    data: TensorDictBase
    tree: Tree
    env: str = ""
    """The env id they were recorded in ("" when unknown)."""
    source: str = ""
    """Free text: who or what acted (e.g. ``"scripted:cartpole-lean"``, ``"human"``)."""

    @property
    def steps(self) -> int:
        """``N``, the number of transitions."""
        return int(self.data.batch_size[0])

    @property
    def episodes(self) -> int:
        """The number of episodes (episode ids run 0, 1, ... in order)."""
        return int(self.data.get(EPISODE_ID)[-1]) + 1 if self.steps else 0

    def episode_returns(self) -> torch.Tensor:
        """``[episodes]`` float64: every agent's rewards of every group, summed over each episode."""
        total = torch.zeros(self.steps, dtype=torch.float64)
        for g in groups(self.tree):
            total += self.data.get((NEXT, g, REWARD)).double().sum((-2, -1))
        return torch.zeros(self.episodes, dtype=torch.float64).index_add_(0, self.data.get(EPISODE_ID), total)


def _name(key: tuple[str, ...]) -> str:
    return ".".join(key)


def dataset_keys(tree: Tree) -> dict[tuple[str, ...], tuple[tuple[int, ...], torch.dtype, bool]]:
    """Every key a dataset of ``tree`` may hold -> (shape past ``N``, dtype, required)."""
    keys: dict[tuple[str, ...], tuple[tuple[int, ...], torch.dtype, bool]] = {
        (EPISODE_ID,): ((), torch.int64, True), (NEXT, TERMINATED): ((1,), torch.bool, True),
        (NEXT, TRUNCATED): ((1,), torch.bool, True)}
    for g, spec in groups(tree).items():
        a = spec.capacity
        for path, leaf in iter_leaves(spec.agent.observation):
            keys[(g, OBSERVATION, *path)] = ((a, *leaf.shape), leaf.dtype, True)
            keys[(NEXT, g, OBSERVATION, *path)] = ((a, *leaf.shape), leaf.dtype, False)
        for path, leaf in iter_leaves(spec.agent.action):
            keys[(g, ACTION, *path)] = ((a, *leaf.shape), leaf.dtype, True)
        action = spec.agent.action
        if getattr(action, "kind", None) == "discrete":  # a single discrete leaf: env action masks apply
            keys[(g, ACTION_MASK)] = ((a, action.n), torch.bool, False)
        keys[(g, MASK)] = ((a,), torch.bool, True)
        keys[(g, LOG_PROB)] = ((a, 1), torch.float32, False)
        keys[(NEXT, g, REWARD)] = ((a, 1), torch.float32, True)
        keys[(NEXT, g, TERMINATED)] = ((a, 1), torch.bool, True)
        keys[(NEXT, g, TRUNCATED)] = ((a, 1), torch.bool, True)
    for path, node in shared_observations(tree).items():
        for sub, leaf in iter_leaves(node):
            keys[(SHARED, *path, *sub)] = (leaf.shape, leaf.dtype, False)
            keys[(NEXT, SHARED, *path, *sub)] = (leaf.shape, leaf.dtype, False)
    return keys


def check_tensors(tensors: Mapping[str, torch.Tensor], tree: Tree, file: str | Path = "dataset") -> TensorDict:
    """Checks flat tensors (``"."``-joined keys) against ``tree`` and returns them as the ``[N]`` TensorDict.

    Refuses unknown and missing keys, wrong shapes and dtypes, an empty dataset, episode ids that do not run
    0, 1, ... with ``("next", "done")`` exactly at each episode's last step, actions out of their bounds or
    illegal under their recorded action mask, and non-finite rewards, log-probabilities or observations (of
    present agents).

    Raises:
        DatasetError: naming ``file`` and the key at fault.
    """
    spec = dataset_keys(tree)
    by_name = {_name(k): k for k in spec}
    unknown = sorted(set(tensors) - set(by_name))
    if unknown:
        raise DatasetError(file, f"unknown key (a dataset of this tree holds {sorted(by_name)})", key=unknown[0])
    missing = [n for n, k in by_name.items() if spec[k][2] and n not in tensors]
    if missing:
        raise DatasetError(file, "missing (a required entry)", key=missing[0])
    n = int(tensors[EPISODE_ID].shape[0]) if tensors[EPISODE_ID].dim() == 1 else -1
    if n < 1:
        raise DatasetError(file, f"must be [N] with N >= 1, got {list(tensors[EPISODE_ID].shape)}", key=EPISODE_ID)
    for name, value in tensors.items():
        tail, dtype, _ = spec[by_name[name]]
        if tuple(value.shape) != (n, *tail) or value.dtype != dtype:
            raise DatasetError(file, f"expected {dtype} of shape {[n, *tail]}, got {value.dtype} "
                               f"{list(value.shape)}", key=name)
    data = TensorDict(batch_size=[n])
    data.set(NEXT, TensorDict(batch_size=[n]))
    for g, gspec in groups(tree).items():
        for root in ((g,), (NEXT, g)):
            data.set(root, TensorDict(batch_size=[n, gspec.capacity]))
    for name, value in tensors.items():
        data.set(by_name[name], value)
    _check_values(data, tree, file)
    return data


def _check_values(data: TensorDict, tree: Tree, file) -> None:
    ids = data.get(EPISODE_ID)
    step = ids[1:] - ids[:-1]
    if int(ids[0]) != 0 or bool(((step != 0) & (step != 1)).any()):
        raise DatasetError(file, "episode ids must run 0, 1, 2, ... with each episode's steps together",
                           key=EPISODE_ID)
    last = torch.cat([step == 1, torch.ones(1, dtype=torch.bool)])
    done = (data.get((NEXT, TERMINATED)) | data.get((NEXT, TRUNCATED))).squeeze(-1)
    if not torch.equal(done, last):
        t = int((done != last).nonzero()[0])
        raise DatasetError(file, f"next.terminated | next.truncated must be set exactly at each episode's last step "
                           f"(transition {t}, episode {int(ids[t])}, differs)",
                           key=f"{NEXT}.{TERMINATED}, {NEXT}.{TRUNCATED}")
    try:
        validate_tree(data, tree, parts=(ACTION,), check_values=True)
    except SpecViolation as error:
        raise DatasetError(file, str(error), key=_name(error.key)) from None
    for g, spec in groups(tree).items():
        present = data.get((g, MASK))
        if not bool(torch.isfinite(data.get((NEXT, g, REWARD))).all()):
            raise DatasetError(file, "NaN or Inf reward", key=_name((NEXT, g, REWARD)))
        for root in ((g,), (NEXT, g)):
            for key, value in data.get(root).items(True, True):
                if value.is_floating_point() and not bool(torch.isfinite(value[present]).all()):
                    raise DatasetError(file, "NaN or Inf at a present agent", key=_name((*root, *_tuple(key))))
        if ACTION_MASK in data.get(g).keys():
            n = spec.agent.action.n  # out-of-range actions of absent agents are clamped: only present ones count
            index = (data.get((g, ACTION)).long() - spec.agent.action.start).clamp(0, n - 1).unsqueeze(-1)
            legal = data.get((g, ACTION_MASK)).gather(-1, index).squeeze(-1)
            if not bool((legal | ~present).all()):
                raise DatasetError(file, "an action of a present agent is illegal under its recorded action_mask",
                                   key=_name((g, ACTION)))


def _tuple(key) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)


def save_dataset(path: str | Path, dataset: Dataset) -> Path:
    """Writes ``dataset`` as a directory at ``path`` (atomically: a temporary directory renamed).

    Raises:
        DatasetError: the data does not fit its tree (checked as :func:`load_dataset` checks it).
        FileExistsError: ``path`` exists.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: a dataset is written once")
    tensors = {_name(_tuple(k)): v.detach().cpu().contiguous() for k, v in dataset.data.items(True, True)}
    check_tensors(tensors, dataset.tree, path)
    header = {"format": FORMAT, "env": dataset.env, "tree": to_json(dataset.tree), "episodes": dataset.episodes,
              "steps": dataset.steps, "source": dataset.source}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    save_file(tensors, str(tmp / TENSORS))
    (tmp / HEADER).write_text(json.dumps(header, indent=1))
    os.replace(tmp, path)
    return path


def load_dataset(path: str | Path) -> Dataset:
    """Reads a dataset written by :func:`save_dataset` (or by any tool following docs/datasets.md).

    Raises:
        DatasetError: a refused dataset, naming the file (and key) at fault: a symbolic link or missing
            file, a header that is not this format's JSON (pickle bytes included), an unreadable tensor file,
            or tensors that do not fit the header's tree and counts (:func:`check_tensors`).
    """
    path = Path(path)
    for file in (path, path / TENSORS, path / HEADER):
        if file.is_symlink() or not file.exists():
            raise DatasetError(file, f"{'a symbolic link' if file.is_symlink() else 'missing'}: a dataset is a "
                               f"directory of two plain files, {TENSORS} and {HEADER}")
    header_file = path / HEADER
    if header_file.stat().st_size > _MAX_JSON:
        raise DatasetError(header_file, f"larger than {_MAX_JSON >> 20} MiB")
    try:
        header = json.loads(header_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(header_file, f"not a JSON document ({error}); headers are JSON, never pickle") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise DatasetError(header_file, f"format must be {FORMAT!r}, got {got!r}", key="format")
    for key in sorted(set(header) | set(_HEADER_TYPES)):
        kind = _HEADER_TYPES.get(key)
        if kind is None:
            raise DatasetError(header_file, f"unknown header field (known: {sorted(_HEADER_TYPES)})", key=key)
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise DatasetError(header_file, f"must be {'an' if kind is int else 'a'} {kind.__name__}, got "
                               f"{header.get(key)!r}", key=key)
    try:
        tree = from_json(header["tree"])
    except (TreeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise DatasetError(header_file, f"not a tree written by core.specs.to_json ({error})", key="tree") from None
    try:
        tensors = load_file(str(path / TENSORS))
    except Exception as error:  # noqa: BLE001 - a malformed or crafted tensor file
        raise DatasetError(path / TENSORS, f"unreadable safetensors file ({error})") from None
    data = check_tensors(tensors, tree, path / TENSORS)
    dataset = Dataset(data, tree, header["env"], header["source"])
    for key, actual in (("steps", dataset.steps), ("episodes", dataset.episodes)):
        if header[key] != actual:
            raise DatasetError(header_file, f"says {header[key]}, the tensors hold {actual}", key=key)
    return dataset


def check_tree(dataset: Dataset, tree: Tree, *, path: str | Path = "", env: str = "") -> None:
    """Raises :class:`DatasetError` (naming the dataset's ``path``, the env it was recorded in, the run's ``env``
    and the first difference of the two trees) unless ``dataset`` was recorded in an env of ``tree``."""
    if (recorded := to_json(dataset.tree)) != (run := to_json(tree)):
        from adapters.external.messages import tree_difference

        where = tree_difference(json.loads(recorded), json.loads(run), here="in the dataset", there="in the run's env")
        raise DatasetError(path or dataset.env or "dataset", f"recorded in {dataset.env or 'another env'}, whose tree "
                           f"differs from {env or 'the run'}'s: {where}", key="tree")


def policy_act(policies: Mapping[str, Any], *, deterministic: bool = False, seed: int = 0) -> Act:
    """An :data:`Act` from group -> :class:`core.policies.GroupPolicy` (feed-forward): samples with a seeded
    generator and records log-probabilities, or acts with the modes (no log-probabilities recorded)."""
    recurrent = [g for g, p in policies.items() if p.recurrent]
    if recurrent:
        raise ValueError(f"groups {recurrent}: recording a recurrent policy needs its state carried; wrap it in a "
                         f"callable that does")
    generator = torch.Generator().manual_seed(seed)

    def act(step: TensorDictBase) -> dict[str, dict[str, Any]]:
        out = {}
        for g, policy in policies.items():
            res = policy.act_step(step.get(g), step.get(SHARED, None), generator, deterministic, with_value=False)
            out[g] = {ACTION: res[ACTION]} if deterministic else {ACTION: res[ACTION], LOG_PROB: res[LOG_PROB]}
        return out

    return act


def _record_step(step: TensorDictBase, acted: Mapping[str, Mapping[str, Any]], nxt: TensorDictBase,
                 sizes: Mapping[str, int]) -> TensorDict:
    """One ``[E]`` transition in the dataset layout (new containers; the env's tensors are only read)."""
    e = step.batch_size[0]
    root = TensorDict(batch_size=[e])
    nxt_out = TensorDict({TERMINATED: nxt.get(TERMINATED), TRUNCATED: nxt.get(TRUNCATED)}, batch_size=[e])
    for g, a in sizes.items():
        gs, gn = step.get(g), nxt.get(g)
        entry = {OBSERVATION: gs.get(OBSERVATION), MASK: gs.get(MASK), ACTION: acted[g][ACTION]}
        if ACTION_MASK in gs.keys():
            entry[ACTION_MASK] = gs.get(ACTION_MASK)
        if acted[g].get(LOG_PROB) is not None:
            entry[LOG_PROB] = acted[g][LOG_PROB].float()
        root.set(g, TensorDict(entry, batch_size=[e, a]))
        # absent agents may carry NaN rewards (the actor's returns treat them as 0 too)
        nxt_out.set(g, TensorDict({OBSERVATION: gn.get(OBSERVATION), REWARD: torch.nan_to_num(gn.get(REWARD)).float(),
                                   TERMINATED: gn.get(TERMINATED), TRUNCATED: gn.get(TRUNCATED)}, batch_size=[e, a]))
    for td, src in ((root, step), (nxt_out, nxt)):
        if SHARED in src.keys():
            td.set(SHARED, src.get(SHARED))
    root.set(NEXT, nxt_out)
    return root


def record_dataset(policy: Act | Any, env, episodes: int, *, seed: int = 0, num_envs: int = 8,
                   deterministic: bool = False, env_kwargs: Mapping[str, Any] | None = None, env_id: str = "",
                   source: str = "", max_steps: int = 1_000_000) -> Dataset:
    """Plays ``episodes`` whole episodes with ``policy`` in ``env`` and returns them as a :class:`Dataset`.

    Episodes are numbered in the order they start (ties: by env index) and the first ``episodes`` of them are
    kept, each played to its end: stopping at the first ``episodes`` to *finish* would favour short ones.

    Args:
        policy: an :data:`Act` callable, a :class:`core.policies.GroupPolicy` (its group), or group -> policy.
        env: an env id (built with :func:`orchestration.envs.make_env`, ``num_envs`` copies, closed after) or
            a :class:`adapters.protocol.BatchedEnv` (left open).
        episodes: how many episodes to keep, >= 1.
        seed: seeds the env's reset and the policy's sampling.
        num_envs: envs played at once when ``env`` is an id.
        deterministic: GroupPolicies act with their modes (then no log-probabilities are recorded).
        env_kwargs: keyword arguments of :func:`make_env` when ``env`` is an id.
        env_id: the id to record when ``env`` is an object.
        source: free text stored in the header.
        max_steps: batched env steps after which recording gives up.

    Raises:
        ValueError: ``episodes < 1``, or the policy acts for no group of the tree / misses one.
        RuntimeError: fewer than ``episodes`` episodes ended within ``max_steps``.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    owned = isinstance(env, str)
    if owned:
        from orchestration.envs import make_env

        env_id, env = env, make_env(env, num_envs, kwargs=dict(env_kwargs or {}))
    try:
        return _record(policy, env, episodes, seed, deterministic, env_id, source, max_steps)
    finally:
        if owned:
            env.close()


def _record(policy, env, episodes: int, seed: int, deterministic: bool, env_id: str, source: str,
            max_steps: int) -> Dataset:
    sizes = {g: spec.capacity for g, spec in groups(env.tree).items()}
    if isinstance(policy, torch.nn.Module):
        policy = {policy.group_name: policy}
    if isinstance(policy, Mapping):
        if set(policy) != set(sizes):
            raise ValueError(f"policies for groups {sorted(policy)}; the env's groups are {sorted(sizes)}")
        policy = policy_act(policy, deterministic=deterministic, seed=seed)
    e = env.num_envs
    current, starts, next_number, kept = list(range(e)), [0] * e, e, 0
    segments: list[tuple[int, int, int, int]] = []  # (episode number, env, first step, last step)
    steps: list[TensorDict] = []
    step = env.reset(seed=seed)
    with torch.no_grad():
        for t in range(max_steps):
            acted = policy(step)
            missing = set(sizes) - set(acted)
            if missing:
                raise ValueError(f"the policy returned no action for groups {sorted(missing)}")
            actions = TensorDict({g: TensorDict({ACTION: acted[g][ACTION]}, batch_size=[e, a])
                                  for g, a in sizes.items()}, batch_size=[e])
            out = env.step(actions)
            nxt = out.get(NEXT)
            steps.append(_record_step(step, acted, nxt, sizes))
            for i in nxt.get(DONE).reshape(e).nonzero().flatten().tolist():
                segments.append((current[i], i, starts[i], t))
                kept += current[i] < episodes
                current[i], starts[i], next_number = next_number, t + 1, next_number + 1
            if kept == episodes:
                break
            step = out  # "next" rides along unread
        else:
            raise RuntimeError(f"only {kept} of {episodes} episodes ended within {max_steps} steps")
    stacked = torch.stack(steps, dim=1)  # [E, T]
    pieces = [stacked[i, first:last + 1] for number, i, first, last in sorted(segments) if number < episodes]
    data = torch.cat(pieces, 0)
    lengths = torch.tensor([p.batch_size[0] for p in pieces])
    data.set(EPISODE_ID, torch.repeat_interleave(torch.arange(episodes), lengths))
    return Dataset(data, env.tree, env_id, source)


__all__ = ["Act", "Dataset", "DatasetError", "FORMAT", "check_tensors", "check_tree", "dataset_keys", "load_dataset",
           "policy_act", "record_dataset", "save_dataset"]
