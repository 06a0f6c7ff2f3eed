"""A trainer's whole state as tensors + JSON (for checkpoints), and its exact restoration.

What makes a resumed run continue exactly like an uninterrupted one: policy weights, optimizer moments,
every generator (minibatch order, action sampling, env), the actors' current observations and episode
bookkeeping, the envs' own state (when the env offers ``state_dict``/``load_state_dict``), and the counters.
An env without ``state_dict`` (most gymnasium envs) is reset on resume instead: training goes on correctly,
but the continuation is no longer bit-identical; ``resume_exact`` in the returned state says which.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import torch

from core.specs import to_json
from orchestration.config import TrainConfig
from orchestration.user_errors import without_colours


def config_to_dict(config) -> dict[str, Any]:
    """A config dataclass as JSON-able dict (tuples become lists), without its secrets (:func:`secret_free`)."""
    return json.loads(json.dumps(secret_free(config)))


def secret_free(config) -> dict[str, Any]:
    """``dataclasses.asdict(config)`` with an external-environment token left out: config files, checkpoints,
    run.json and experiment trackers are not secrets (the run writes its token to its own 0600 file)."""
    out = dataclasses.asdict(config)
    if isinstance(out.get("external"), dict) and out["external"].get("token"):
        out["external"]["token"] = ""
    return out


def trainer_state(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, tensors, json_state)`` of any trainer (:meth:`Trainer.state`), one format for every backend.

    weights: ``"<policy>/<param>"``; tensors: ``optimizer/<policy>/...``, ``rng/learner/<policy>``,
    ``returns/<policy>/...`` (reward scaling), ``curiosity/<policy>/...`` (RND), ``actor/<i>/...``, ``evaluator/...``,
    ``rng/collection``, ``team_critic/weights/...``, ``team_critic/optimizer/...`` and ``rng/team_critic`` (a
    team critic); JSON: counters, history, config (with an env collection's document), tree, optimizer
    hyper-parameters, inbox ledgers, the collection's state, the team critic's version, counters and ledger.
    """
    raw = trainer.state()
    weights, tensors = {}, {}
    state: dict[str, Any] = {"config": config_to_dict(trainer.config), "tree": to_json(trainer.tree),
                             "iteration": raw["iteration"], "env_steps": raw["env_steps"], "produced": raw["produced"],
                             "episodes_total": raw["episodes_total"], "history": raw["history"],
                             "agent_history": raw["agent_history"],
                             "learners": {}, "actors": [],
                             "resume_exact": raw["resume_exact"]}
    for pid, learner in raw["learners"].items():
        weights.update({f"{pid}/{k}": _tensor(v) for k, v in learner["weights"].items()})
        entry: dict[str, Any] = {"version": learner["version"], "counters": learner["counters"]}
        if "optimizer" in learner:
            opt_tensors, entry["optimizer"] = learner["optimizer"]
            tensors.update({f"optimizer/{pid}/{k.split('/', 1)[1]}": _tensor(v) for k, v in opt_tensors.items()})
            tensors[f"rng/learner/{pid}"] = _tensor(learner["generator"])
            entry["inbox"] = learner["inbox"]
        tensors.update({f"returns/{pid}/{k}": _tensor(v) for k, v in learner.get("returns", {}).items()})
        tensors.update({f"curiosity/{pid}/{k}": _tensor(v) for k, v in learner.get("curiosity", {}).items()})
        state["learners"][pid] = entry
    for i, actor in enumerate(raw["actors"]):
        tensors.update({f"actor/{i}/{k}": v for k, v in actor["tensors"].items()})
        state["actors"].append(actor["json"])
    if "evaluator" in raw:  # the evaluation actor (its envs' state, generator and observations)
        tensors.update({f"evaluator/{k}": v for k, v in raw["evaluator"]["tensors"].items()})
        state["evaluator"] = raw["evaluator"]["json"]
    if "collection" in raw:  # an environment collection's state (orchestration.collection_driver)
        state["collection"] = raw["collection"]["json"]
        tensors["rng/collection"] = raw["collection"]["rng"]
    if "team_critic" in raw:  # orchestration.team_critic
        critic = raw["team_critic"]
        tensors.update({f"team_critic/weights/{k}": _tensor(v) for k, v in critic["weights"].items()})
        opt_tensors, meta = critic["optimizer"]
        tensors.update({f"team_critic/{k}": _tensor(v) for k, v in opt_tensors.items()})  # optimizer/state/...
        tensors["rng/team_critic"] = _tensor(critic["generator"])
        state["team_critic"] = {"version": critic["version"], "counters": critic["counters"], "optimizer": meta,
                                "inbox": critic["inbox"]}
    return weights, tensors, state


def restore_trainer_(trainer, weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                     state: dict[str, Any]) -> None:
    """Loads a checkpoint's state into a freshly built trainer of the same config (mutates it)."""
    learners = {}
    for pid, entry in state["learners"].items():
        own = {k.split("/", 1)[1]: v for k, v in weights.items() if k.startswith(f"{pid}/")}
        learner: dict[str, Any] = {"weights": own, "version": entry["version"], "counters": entry["counters"]}
        if "optimizer" in entry:
            head = f"optimizer/{pid}/"
            learner["optimizer"] = ({f"optimizer/{k[len(head):]}": v for k, v in tensors.items() if k.startswith(head)},
                                    entry["optimizer"])
            learner["generator"] = tensors[f"rng/learner/{pid}"]
            if "inbox" in entry:
                learner["inbox"] = entry["inbox"]
            head = f"returns/{pid}/"  # reward scaling's return accumulators (orchestration.reward_scaling)
            learner["returns"] = {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}
        head = f"curiosity/{pid}/"  # the RND networks, optimizer and statistics (orchestration.curiosity)
        if curiosity := {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}:
            learner["curiosity"] = curiosity
        learners[pid] = learner
    actors = []
    for i, meta in enumerate(state["actors"]):
        head = f"actor/{i}/"
        actors.append({"tensors": {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}, "json": meta})
    extra = {"collection": {"json": state["collection"], "rng": tensors["rng/collection"]}} \
        if "collection" in state else {}
    if "evaluator" in state:
        extra["evaluator"] = {"tensors": {k[len("evaluator/"):]: v for k, v in tensors.items()
                                          if k.startswith("evaluator/")}, "json": state["evaluator"]}
    if "team_critic" in state:
        entry, head = state["team_critic"], "team_critic/weights/"
        extra["team_critic"] = {
            "weights": {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)},
            "optimizer": ({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("team_critic/optimizer/")},
                          entry["optimizer"]),
            "generator": tensors["rng/team_critic"], "version": entry["version"], "counters": entry["counters"],
            "inbox": entry["inbox"]}
    try:
        trainer.load_state_({"iteration": state["iteration"], "env_steps": state["env_steps"],
                             "produced": state.get("produced", 0), "episodes_total": state.get("episodes_total", 0),
                             "history": state["history"],
                             "agent_history": state.get("agent_history", {}), "learners": learners,
                             "actors": actors, **extra})
    except (RuntimeError, ValueError) as err:
        raise _other_tree(trainer, state) or err


def _other_tree(trainer, state: dict[str, Any]) -> ValueError | None:
    """A state that did not load into ``trainer``: a ValueError naming both envs and the first difference of their
    trees when the checkpoint's run played another tree (another env, or keywords that reshape it), else None."""
    saved = state.get("tree")
    if not isinstance(saved, str) or (mine := to_json(trainer.tree)) == saved:
        return None
    from adapters.external.messages import tree_difference

    env, saved_env = trainer.config.env, state["config"]["env"]
    where = tree_difference(json.loads(mine), json.loads(saved), here=f"in {env}", there=f"in {saved_env}'s")
    return ValueError(f"the checkpoint's run played {saved_env}, and this run's {env} has other agents, observations "
                      f"or actions: {where}. Resume it on its own env (--env {saved_env}, with its --env-kwargs), "
                      f"or train a new run in another --run-dir")


def _tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))


def load_config(state: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` stored in a checkpoint's state.

    Raises:
        ValueError: a field that is unknown or out of range, named (the config's own validation).
    """
    try:
        return _load_config(state)
    except TypeError as err:  # an unknown or missing field: dataclasses name it
        raise ValueError(f"checkpoint config: {err}") from err
    except KeyError as err:  # a section every saved config has
        raise ValueError(f"checkpoint config: it has no {err.args[0]!r} section (state.json's config is not a "
                         f"run's whole TrainConfig)") from None


def _load_config(state: dict[str, Any]) -> TrainConfig:
    from core.losses import PPOConfig
    from core.policies.config import policy_config_from_dict
    from orchestration.config import (CuriosityConfig, ExternalConfig, PastSelvesConfig, PretrainConfig, RayConfig,
                                      RolloutConfig)
    from orchestration.team_critic_config import TeamCriticConfig

    raw = dict(state["config"])
    raw["rollout"] = RolloutConfig(**raw["rollout"])
    raw["ppo"] = PPOConfig(**raw["ppo"])
    raw["policy"] = policy_config_from_dict(raw["policy"])
    raw["env_kwargs"] = tuple(tuple(p) for p in raw["env_kwargs"])
    raw["policy_mapping"] = tuple(tuple(p) for p in raw.get("policy_mapping", ()))
    raw["fixed_policies"] = tuple(raw.get("fixed_policies", ()))
    ray_raw = dict(raw.get("ray", {}))
    ray_raw["learner_resources"] = tuple(tuple(p) for p in ray_raw.get("learner_resources", ()))
    for moved in ("mode", "max_staleness", "reuse_limit"):  # RayConfig fields before they applied to every backend
        if moved in ray_raw:
            raw.setdefault(moved, ray_raw.pop(moved))
    raw["ray"] = RayConfig(**ray_raw)
    raw["external"] = ExternalConfig(**raw.get("external", {}))
    raw["pretrain"] = PretrainConfig(**raw.get("pretrain", {}))
    raw["curiosity"] = CuriosityConfig(**raw.get("curiosity", {}))
    critic = dict(raw.get("team_critic", {}))  # older runs: none
    critic["hidden_sizes"] = tuple(critic.get("hidden_sizes", TeamCriticConfig().hidden_sizes))
    raw["team_critic"] = TeamCriticConfig(**critic)
    raw["past_selves"] = PastSelvesConfig(**raw.get("past_selves", {"fraction": 0.0}))  # older runs: plain self-play
    return TrainConfig(**raw)


def changed_settings(saved: TrainConfig, config: TrainConfig, ignore: tuple[str, ...] = ("iterations", "run_dir")) -> list[str]:
    """``--flag saved -> now`` for every setting (dotted path, as a flag) where ``config`` differs from ``saved``."""
    def flat(value, prefix: str = "") -> dict[str, Any]:
        if dataclasses.is_dataclass(value):
            return {k: v for f in dataclasses.fields(value) for k, v in flat(getattr(value, f.name),
                                                                              f"{prefix}{f.name}.").items()}
        return {prefix.rstrip("."): value}

    before, after = flat(saved), flat(config)
    return [f"--{key.replace('_', '-')} {before[key]!r} -> {after[key]!r}" for key in after
            if key not in ignore and before.get(key) != after[key]]


_SHAPING = ("env", "env_kwargs", "collection", "policy.", "policy_mapping", "fixed_policies", "curiosity.",
            "team_critic.", "past_selves.", "rollout.num_envs", "rollout.num_workers", "ray.learners_per_policy",
            "external.tree")
"""Settings a checkpoint's tensor shapes (or its set of learners and env states) depend on."""

#: What torch says when a checkpoint's tensors do not fit: other shapes, or state a setting adds or takes away
#: (observation statistics, a reward scaler, a recurrent cell)
_MISFITS = ("size", "shape", "Unexpected key(s)", "Missing key(s)")


def misfit(err: BaseException, saved, config) -> BaseException:
    """What a resume whose checkpoint does not fit raises: a ValueError naming each setting changed since the
    checkpoint (``saved``, a TrainConfig) and the mismatch torch found (a size or shape); ``err`` itself for
    another error, or when no setting changed."""
    text = str(err)
    if not any(w in text for w in _MISFITS) or not (changed := changed_settings(saved, config)):
        return err  # another fault (a missing player checkpoint, say): not the changed settings' doing
    shaping = [c for c in changed if any(key == s or (s.endswith(".") and key.startswith(s)) for s in _SHAPING
                                         for key in [c.split()[0][2:].replace("-", "_")])]
    changed = shaping or changed  # a changed --lr next to a changed --policy.hidden-sizes is not the misfit
    return ValueError(f"--resume: the checkpoint in {config.run_dir} does not fit this run, which changes "
                      f"{'; '.join(changed)} ({shape_detail(err.__cause__ or err)}). Resume without changing "
                      f"{'it' if len(changed) == 1 else 'them'}, or train a new run in another --run-dir")


def load_policy_weights_(policy: torch.nn.Module, weights: dict[str, torch.Tensor], pid: str) -> None:
    """Loads the ``pid/`` entries of a checkpoint's ``weights`` into ``policy`` (built from its config).

    Raises:
        ValueError: it holds none (naming the policies it has), or another network's (torch's mismatch line).
    """
    own = {k[len(pid) + 1:]: v for k, v in weights.items() if k.startswith(f"{pid}/")}
    if not own:
        raise ValueError(f"checkpoint policy {pid!r} has no weights (no '{pid}/' keys); its policies are "
                         f"{sorted({k.split('/', 1)[0] for k in weights})}")
    try:
        policy.load_state_dict(own)
    except RuntimeError as err:
        raise ValueError(f"checkpoint policy {pid!r}: its weights are another network's than the one its config "
                         f"builds ({shape_detail(err)}); were they copied from another run?") from None


def shape_detail(err: BaseException) -> str:
    """The line of a failed restore that names the mismatch (torch's "size mismatch for ...", also inside a Ray
    actor's error, whose first lines name the actor), without terminal colours."""
    lines = [line.strip() for line in without_colours(str(err)).splitlines() if line.strip()]
    line = next((line for word in ("size", "key(s)") for line in lines if word in line),
                lines[-1] if lines else type(err).__name__)
    if len(line) > 240:  # a state dict's missing or unexpected keys: the first few say it
        line = line[:240].rsplit(",", 1)[0] + ", ..."
    return line.rstrip(".")  # it goes inside parentheses, before the sentence's own full stop


__all__ = ["changed_settings", "config_to_dict", "load_config", "load_policy_weights_", "misfit", "restore_trainer_",
           "secret_free", "shape_detail", "trainer_state"]
