"""Environment collections in a run (seed 002): the collection a config declares and the checks on its members.

:mod:`core.envsets` holds the pure logic (which env to train on, which to evaluate on, promotion, weights,
prior draws); this module and :mod:`orchestration.collection_env` build and run the envs, on every backend:

- :func:`load_collection` reads ``TrainConfig.collection`` (a ``.json``/``.yaml`` file or the JSON document)
  and :func:`with_collection` puts the canonical JSON document back in the config: that is what checkpoints
  store, so a resumed run never reads the file again. A document (as opposed to a file the user named) may
  only name envs that import no code (:func:`orchestration.envs.imports_code`), the rule an env read from a
  checkpoint follows;
- :func:`probe_members` builds every member once at startup and refuses members whose trees differ, naming
  both env ids and the first differing key, and priors over envs that cannot draw per-episode parameters;
- :mod:`orchestration.collection_env` runs one member at a time per actor and switches members at fragment
  boundaries; with a prior, each episode's parameters are drawn at the row's reset.

Usage (what the builder, the fleets and the trainer do)::

    collection = load_collection(config)                # None without one
    config = with_collection(config, collection)        # the document, as checkpoints store it
    tree = probe_members(config, collection)            # each member built once, trees compared
    env = make_actor_env(config, num_envs)              # orchestration.collection_env: one member at a time
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from core.envsets import EnvCollection, PriorDistribution, collection_from_dict, collection_to_dict
from core.specs.serialize import tree_to_dict
from orchestration.envs import imports_code, make_run_env

#: Prefix of the per-env keys of episode records and metrics (``episode_return_mean/env:<id>``).
ENV_KEY = "env:"
#: Per-env metrics a curriculum or an adversarial set may name (``Curriculum.metric``), over the last
#: ``window`` finished episodes of that env; ``episodes`` counts those of the last iteration.
PER_ENV_METRICS = ("mean_return", "episode_return_mean", "mean_length", "episode_length_mean", "episodes")


def load_collection(config, *, trusted: bool = False) -> EnvCollection | None:
    """The collection ``config.collection`` declares (None without one).

    Args:
        config: a :class:`orchestration.config.TrainConfig`.
        trusted: the document was checked before (a config this run resolved); otherwise a JSON document
            (what a checkpoint holds) must name only envs that import no code. A file is always trusted:
            the user named it.

    Raises:
        ValueError: a malformed document (:class:`core.envsets.CollectionError`, naming the field), a
            file of another kind, a member env that would import code, or settings collections do not
            support (external envs, env polling, a metric no run reports).
    """
    text = config.collection
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        collection = EnvCollection.from_json(text)
        if not trusted:
            for env_id, member in collection.members.items():
                if why := imports_code(member.env):
                    raise ValueError(f"collection member {env_id!r} names env {member.env!r}; {why}, and a "
                                     f"collection given as a JSON document (as a checkpoint stores it) never "
                                     f"imports code: name the collection file yourself (--collection FILE)")
    else:
        collection = collection_from_dict(_read(Path(text)))
    _check_usable(config, collection)
    return collection


def _read(path: Path) -> Any:
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"TrainConfig.collection: expected a .json or .yaml file or a JSON document "
                         f"('{{\"format\": ...}}'), got {str(path)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"TrainConfig.collection: no file {str(path)!r}")
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def _check_usable(config, collection: EnvCollection) -> None:
    if config.env == "external":
        raise ValueError("TrainConfig.collection: external environments connect by themselves; a collection "
                         "needs envs this run builds")
    if config.rollout.env_polling:
        raise ValueError("TrainConfig.collection: an actor switches members over all its envs at a fragment "
                         "boundary, which rollout.env_polling has none of; turn env_polling off")
    metric = getattr(collection.structure, "metric", None)
    if metric is not None and metric not in PER_ENV_METRICS:
        raise ValueError(f"collection: metric {metric!r} is not reported per env; one of: "
                         f"{', '.join(PER_ENV_METRICS)}")


def with_collection(config, collection: EnvCollection | None):
    """``config`` with ``collection`` as its canonical JSON document (unchanged without one)."""
    if collection is None:
        return config
    return dataclasses.replace(config, collection=collection.to_json())


def member_config(config, collection: EnvCollection, env_id: str):
    """The config of one member: ``env`` and ``env_kwargs`` are the member's, no collection."""
    member = collection.member(env_id)
    plain = collection_to_dict(collection)["members"][env_id]
    kwargs = plain["kwargs"] if isinstance(plain, dict) else {}
    return dataclasses.replace(config, env=member.env, collection=None,
                               env_kwargs=tuple((k, repr(v)) for k, v in kwargs.items()))


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first key where two JSON values differ, as ``(dotted path, value in a, value in b)``; None if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return where, a.get(key, "<absent>"), b.get(key, "<absent>")
            found = first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    return None if a == b else (path or "<root>", a, b)


def check_same_tree(collection: EnvCollection, id_a: str, tree_a, id_b: str, tree_b) -> None:
    """Raises a ValueError naming both env ids and the first differing key when the trees differ."""
    diff = first_difference(tree_to_dict(tree_a), tree_to_dict(tree_b))
    if diff is not None:
        key, va, vb = diff
        raise ValueError(f"collection members {id_a!r} ({collection.member(id_a).env}) and {id_b!r} "
                         f"({collection.member(id_b).env}) have different trees: first difference at {key!r} "
                         f"({_short(va)} vs {_short(vb)}); every member of a collection must share one tree")


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) and value.startswith("<") else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_params_supported(collection: EnvCollection, env_id: str, env) -> None:
    """Refuses a prior over an env that cannot draw per-episode parameters, naming it and what is supported."""
    prior = collection.structure
    if not isinstance(prior, PriorDistribution):
        return
    from adapters.builtin.cartpole import EPISODE_PARAMS

    supported = f"builtin:cartpole ({', '.join(EPISODE_PARAMS)}) in the actor's process (env_processes 0)"
    takes = getattr(env, "episode_params", None)
    if hasattr(env, "worker_pids") and collection.member(env_id).env.startswith("builtin:cartpole"):  # a pool
        raise ValueError(f"collection member {env_id!r} (env {collection.member(env_id).env!r}) draws its prior's "
                         f"per-episode parameters in the actor's process only, and this run steps its envs in env "
                         f"processes (--rollout.env-processes, --rollout.env-timeout-s or --rollout.check lenient): "
                         f"drop those flags for this collection")
    if takes is None or not hasattr(env, "set_param_sampler"):
        raise ValueError(f"collection member {env_id!r} (env {collection.member(env_id).env!r}) cannot take "
                         f"per-episode parameters, which its prior draws; envs that can: {supported}")
    unknown = sorted(set(prior.params) - set(takes))
    if unknown:
        raise ValueError(f"collection member {env_id!r} (env {collection.member(env_id).env!r}) cannot take the "
                         f"per-episode parameters {unknown}; it takes {', '.join(takes)}")


def probe_members(config, collection: EnvCollection):
    """Builds every member once (one env each) and returns their common tree.

    Raises:
        ValueError: two members with different trees (both ids and the first differing key named), a member that
            cannot be built (its id named: a keyword its env does not take, ...), or a prior over an env that
            cannot draw per-episode parameters.
    """
    first, tree = None, None
    for env_id in collection.ids:
        try:
            env = make_run_env(member_config(config, collection, env_id), 1)
        except ValueError as err:  # a member's kwargs are the collection's, not --env-kwargs
            raise ValueError(f"collection env {env_id!r}: {str(err).replace('--env-kwargs ', 'kwargs ')}") from None
        try:
            if tree is None:
                first, tree = env_id, env.tree
            else:
                check_same_tree(collection, first, tree, env_id, env.tree)
            check_params_supported(collection, env_id, env)
        finally:
            env.close()
    return tree


__all__ = ["ENV_KEY", "PER_ENV_METRICS", "check_params_supported", "check_same_tree", "first_difference",
           "load_collection", "member_config", "probe_members", "with_collection"]
