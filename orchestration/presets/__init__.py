"""Tuned training configurations shipped with Shoal: ``shoal train --preset NAME`` (flags override them).

Each preset is a YAML file of this package holding any subset of :class:`orchestration.config.TrainConfig`'s
fields, nested as the dataclasses are, with the step budget it was measured with (``iterations``); its comment
says what it reaches. ``benchmarks/learning_table.py`` trains every preset over its budget and reports the final
returns beside published ones. Config files (``--config-file``) are read by the same strict loader.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from importlib import resources
from typing import Any

from orchestration.config import TrainConfig


def preset_names() -> tuple[str, ...]:
    """The names of the shipped presets, sorted (``cartpole``, ``pendulum``, ...)."""
    return tuple(sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".yaml")))


def load_preset(name: str, base: TrainConfig | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of preset ``name`` (its fields applied over ``base``, default ``TrainConfig()``).

    Raises:
        ValueError: an unknown name, in one paragraph naming the valid ones and the nearest.
    """
    names = preset_names()
    if name not in names:
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.4)
        raise ValueError(f"unknown preset {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; the presets are: {', '.join(names)}")
    text = resources.files(__name__).joinpath(f"{name}.yaml").read_text()
    return config_from_mapping(_parse(text, f"preset {name}", yaml=True), base or TrainConfig(), f"preset {name}")


def config_from_file(path: str, base: TrainConfig | None = None) -> TrainConfig:
    """A TrainConfig from a YAML or JSON file (any subset of the fields, nested as the dataclasses are) applied
    over ``base`` (default ``TrainConfig()``); strict: an unknown key is an error naming it and its nearest
    valid spelling."""
    with open(path) as f:
        raw = _parse(f.read(), f"config file {path}", yaml=path.endswith((".yaml", ".yml")))
    return config_from_mapping(raw, base or TrainConfig(), f"config file {path}")


def config_from_mapping(raw: dict[str, Any], base: TrainConfig, where: str) -> TrainConfig:
    """``base`` with the fields of ``raw`` (a parsed config document) applied, keys checked strictly."""
    from orchestration.sweeps import config_from_params

    _check_keys(raw, base, "", where)
    if isinstance(raw.get("collection"), dict):  # an env collection written out in the file: its JSON document
        raw = {**raw, "collection": json.dumps(raw["collection"])}
    try:
        return config_from_params(base, raw)  # YAML's ``1e-3`` (a string to YAML 1.1) becomes a float
    except (ValueError, TypeError) as error:  # a value of the wrong kind, or one the config's own checks refuse
        raise ValueError(f"{where}: {error}") from None


def _parse(text: str, where: str, *, yaml: bool) -> dict[str, Any]:
    if yaml:
        import yaml as pyyaml

        try:
            raw = pyyaml.safe_load(text)
        except pyyaml.YAMLError as error:
            raise ValueError(f"{where} is not valid YAML: {error}") from None
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of TrainConfig fields, got {type(raw).__name__}")
    return raw


def _check_keys(raw: dict, config: Any, prefix: str, where: str) -> None:
    """Refuses a key that is no field of ``config`` (a dataclass), naming it and its nearest valid spelling."""
    names = [f.name for f in dataclasses.fields(config)]
    for key, value in raw.items():
        if key not in names and "." in str(key) and dataclasses.is_dataclass(getattr(config, key.split(".")[0], None)):
            section, rest = key.split(".", 1)
            raise ValueError(f"{where}: key '{prefix}{key}' is a dotted path; a config file nests its sections: "
                             f"{section}: {{{rest}: ...}} (dotted keys are for a sweep's search section)")
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            raise ValueError(f"{where}: unknown key '{prefix}{key}'" + (f" (did you mean '{prefix}{near[0]}'?)"
                             if near else f"; valid keys: {', '.join(names)}"))
        field = getattr(config, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(field):
            _check_keys(value, field, f"{prefix}{key}.", where)


__all__ = ["config_from_file", "config_from_mapping", "load_preset", "preset_names"]
