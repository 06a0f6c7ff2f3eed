"""The keywords an environment takes (``--env-kwargs``) and their types, read from what each family declares,
so that a misspelt keyword or a value of the wrong type is named before the env is built, with the nearest
keyword it takes: a dataclass config (``builtin:``), a signature with annotations (gymnasium ids and
``gymnasium.make``, PettingZoo/mpe2 ``raw_env``, users' factories), or, for VMAS scenarios, the keywords a
scenario's ``make_world`` pops from its ``**kwargs`` (typed by their defaults) with those of VMAS and torchrl's
``VmasEnv``. Anything these do not tell is left to the env's own checks."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
import typing
from typing import Any

#: Keywords Shoal's adapters take for a family, whatever the env (popped before the env is built).
_ADAPTER_KEYWORDS = {"vmas": ("payoff", "seed"), "mpe2": ("payoff", "action_mask", "state", "aec"),
                     "pettingzoo": ("payoff", "action_mask", "state", "aec")}


#: Keywords Shoal passes itself to the envs of a family, with the flag that sets them.
_SET_BY_SHOAL = {family: {"num_envs": "--rollout.num-envs"} for family in ("builtin", "vmas", "torchrl")}

_PAYOFFS = ("cooperative", "zero_sum", "general")  # core.specs.PAYOFFS, without importing torch here
_MASK_SOURCES = ("auto", "observation", "info", "none")  # adapters.action_masks.MASK_SOURCES, without torch


def factory_of(name: str):
    """The callable ``module:attr`` names, or None when ``attr`` is not an attribute of the module (then
    ``name`` is gymnasium's ``module:EnvId`` form: gymnasium imports the module and looks the id up)."""
    module_name, attr = name.split(":", 1)
    if module_name.startswith(".") or "/" in module_name or module_name.endswith(".py"):  # a path, not a module
        module = ".".join(p for p in module_name.removesuffix(".py").split("/") if p not in ("", ".", ".."))
        module = module.lstrip(".") or "my_envs"
        raise ValueError(f"env {name!r}: a custom env is given as package.module:factory, a module name with its "
                         f"directory importable (e.g. on PYTHONPATH), not a file path or a relative import: "
                         f"--env {module}:{attr}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"env {name!r}: cannot import module {module_name!r} ({err}); a custom env is given as "
                         f"package.module:factory, with the package importable (e.g. on PYTHONPATH)") from None
    factory = getattr(module, attr, None)
    return factory if callable(factory) else None


def check_values(name: str, kwargs: dict[str, Any]) -> None:
    """Raises ValueError naming the first keyword that env ``name`` does not take, where it checks none itself
    (a VMAS scenario only warns), and the first whose value (one a literal gives: a bool, number or string) is
    not of its parameter's type (``--env-kwargs max_steps abc`` for an ``int``): the env would fail later, deep
    inside, or silently take it. Other values (numpy scalars, devices from Python) and types not known are
    left to the env."""
    from orchestration.config_kinds import PYTHON_WORDS, allows, describe

    for key, flag in _SET_BY_SHOAL.get(name.split(":", 1)[0] if ":" in name else "", {}).items():
        if key in kwargs:
            raise ValueError(f"env {name!r}: --env-kwargs {key} is Shoal's to set: use {flag} {kwargs[key]}")
    torch_device = name.split(":", 1)[0] in ("builtin", "vmas", "torchrl")  # the others may mean their own thing
    if isinstance(device := kwargs.get("device"), str) and (why := _unusable(device, torch_device)):
        raise ValueError(f"env {name!r}: --env-kwargs device {device!r}: {why}; use --env-kwargs device cpu")
    params = parameters(name) if kwargs else {}
    factory = ":" in name and name.split(":", 1)[0] not in ("builtin", "vmas", "mpe2", "pettingzoo", "torchrl")
    for key, kind, choices in (("payoff", "payoff", _PAYOFFS), ("action_mask", "mask source", _MASK_SOURCES)):
        value = kwargs.get(key, choices[0])  # the adapters' keywords (a factory's own keyword of the name is its)
        if isinstance(value, str) and value not in choices and not (factory and key in params):
            import difflib

            near = difflib.get_close_matches(value, choices, n=1)
            raise ValueError(f"env {name!r}: --env-kwargs {key} {value!r} is not a {kind}"
                             + (f" (did you mean {near[0]!r}?)" if near else f"; they are {', '.join(choices)}"))
    if name.startswith("vmas:") and params:
        from core.envsets.ids import hint  # imports torch: only on this path (the command's --help stays light)

        for key in kwargs:
            if key not in params:
                raise ValueError(f"env {name!r}: --env-kwargs {key} is not a keyword it takes"
                                 f"{hint(key, params, rest_as='it takes {}')}")
    for key, value in kwargs.items():
        want = params.get(key)
        if want is None or type(value) not in (bool, int, float, str) or allows(want, value):
            continue
        raise ValueError(f"env {name!r}: --env-kwargs {key} {value!r} is {PYTHON_WORDS[type(value)]}, but {key} "
                         f"takes {describe(want, PYTHON_WORDS)} (values are read as Python literals: e.g. 3, 0.5, "
                         f"True, 'text')")


def _unusable(device: str, torch_device: bool) -> str | None:
    """Why this process cannot put an env on ``device`` (a CUDA or MPS one it does not have; with
    ``torch_device``, an env that takes a torch device, not a device at all), else None."""
    import torch

    try:
        kind = torch.device(device)
    except RuntimeError:  # another env's own word for a device is its own to check
        return "not a device (cpu, cuda, cuda:<index> or mps)" if torch_device else None
    if kind.type == "cuda" and (kind.index or 0) >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        return (f"no such CUDA device here (torch {torch.__version__}, {torch.cuda.device_count()} visible; a Ray "
                f"rollout worker sees a GPU only when it reserves one: --ray.worker-num-gpus)")
    if kind.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available here"
    return None


def parameters(name: str) -> dict[str, Any]:
    """The keyword arguments env ``name`` takes, each with its type (an annotation, resolved; None where none
    is known), where the env declares them (else none: messages go without)."""
    family = name.split(":", 1)[0] if ":" in name else ""
    try:
        if family == "builtin":
            from adapters import builtin

            configs = {n.lower(): getattr(builtin, n) for n in builtin.__all__ if n.endswith("Config")}
            config = configs[f"{name.split(':', 1)[1]}config"]
            hints = typing.get_type_hints(config)
            return {f.name: hints.get(f.name) for f in dataclasses.fields(config) if f.name != "num_envs"}
        if family == "vmas":
            return _vmas_parameters(name.split(":", 1)[1].removesuffix(".py"))
        if family in ("mpe2", "pettingzoo"):
            module = importlib.import_module(f"{'mpe2' if family == 'mpe2' else 'pettingzoo'}.{name.split(':', 1)[1]}")
            raw = getattr(module, "raw_env", None)
            if raw is None:
                return {}
            return {**_signature(raw), **dict.fromkeys(_ADAPTER_KEYWORDS[family])}
        if family in ("torchrl", "external"):
            return {}  # their own checks name a bad keyword
        made: dict[str, Any] = {}
        if family:
            creator = factory_of(name)
        else:
            import gymnasium
            from gymnasium.envs.registration import load_env_creator

            creator = gymnasium.spec(name).entry_point
            creator = load_env_creator(creator) if isinstance(creator, str) else creator
            made = {p: h for p, h in _signature(gymnasium.make).items() if p not in ("id", "kwargs")}
        return made if creator is None else {**made, **_signature(creator)}
    except Exception:  # noqa: BLE001 - a hint only: no signature, no hint
        return {}


def _signature(creator) -> dict[str, Any]:
    """``creator``'s keyword parameters with their annotations (None where one does not resolve)."""
    try:
        hints = typing.get_type_hints(creator.__init__ if inspect.isclass(creator) else creator)
    except Exception:  # noqa: BLE001 - annotations that do not resolve: names only
        hints = {}
    return {p: hints.get(p) for p, v in inspect.signature(creator).parameters.items()
            if p != "self" and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)}


def _vmas_parameters(scenario: str) -> dict[str, Any]:
    """The keywords of VMAS scenario ``scenario``: those its ``make_world`` pops or gets from ``**kwargs`` (typed
    by a literal default: bool, a number or str), VMAS's ``make_env``'s and torchrl ``VmasEnv``'s; ``{}`` unless
    the scenario checks that every keyword was used (then an unused one would only be warned about)."""
    import vmas
    from torchrl.envs.libs.vmas import VmasEnv

    source = textwrap.dedent(inspect.getsource(importlib.import_module("vmas.scenarios").load(
        f"{scenario}.py").Scenario.make_world))
    if "check_kwargs_consumed" not in source:
        return {}
    popped: dict[str, Any] = {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "get")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "kwargs" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            default = node.args[1] if len(node.args) > 1 else None
            if isinstance(default, ast.UnaryOp) and isinstance(default.operand, ast.Constant):
                default = default.operand  # -1
            value = default.value if isinstance(default, ast.Constant) else None
            popped[node.args[0].value] = (bool if isinstance(value, bool) else int | float if isinstance(
                value, (int, float)) else str if isinstance(value, str) else None)
    return {**dict.fromkeys([*_signature(vmas.make_env), *_signature(VmasEnv), *_ADAPTER_KEYWORDS["vmas"]]),
            **popped}


__all__ = ["check_values", "factory_of", "parameters"]
