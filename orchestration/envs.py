"""Environment names to batched envs: the one place that knows every adapter (the composition root's helper).

Names:
- ``builtin:cartpole``, ``builtin:spread``, ``builtin:spot`` (an image task), ``builtin:recall`` (a memory
  task), ``builtin:pick`` (a structured two-stage action): Shoal's own vectorised torch envs;
- ``mpe2:simple_spread_v3`` (any mpe2 module), ``pettingzoo:classic.connect_four_v3`` (any PettingZoo module):
  parallel or AEC PettingZoo envs, ``num_envs`` copies batched;
- ``vmas:navigation`` (any VMAS scenario): one vectorised VMAS env through torchrl's ``VmasEnv`` and
  :class:`adapters.torchrl_env.TorchRLEnv` (``--env-kwargs n_agents 3 continuous_actions False`` ...);
- ``torchrl:CartPole-v1`` (any gymnasium id): torchrl's ``GymEnv`` with ``num_envs`` (its vectorised env) through
  :class:`adapters.torchrl_env.TorchRLEnv`;
- ``package.module:factory``: a user's factory (no arguments but ``env_kwargs``) returning a gymnasium env, a
  PettingZoo parallel or AEC env, or a batched torchrl env (:func:`from_factory`);
- anything else: a gymnasium id (``CartPole-v1``, or gymnasium's ``module:EnvId``), vectorised with
  ``SyncVectorEnv``.

mpe2, VMAS, PettingZoo's classic and butterfly games and gymnasium's Box2D envs need optional packages
(``shoal[mpe2]``, ``shoal[vmas]``, ``shoal[classic]``, ``shoal[butterfly]``, ``shoal[box2d]``): without them
:func:`make_env` raises :class:`adapters.extras.MissingExtra`, naming the ``pip install`` that brings them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import numbers
import pkgutil
import re
from functools import partial
from pathlib import Path
from typing import Any, Iterable

from adapters.extras import EXTRAS, extra_for, is_installed, missing_extra, require
from orchestration.env_parameters import check_values, factory_of, parameters


def parse_kwargs(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """``(("max_cycles", "25"),)`` -> ``{"max_cycles": 25}`` (values are Python literals, else strings)."""
    out = {}
    for key, text in pairs:
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def make_env(name: str, num_envs: int, *, check: str = "strict", kwargs: dict[str, Any] | None = None,
             shared_state: bool | None = None):
    """Builds ``num_envs`` envs of ``name`` behind :class:`adapters.protocol.BatchedEnv`.

    ``shared_state=False`` leaves a PettingZoo env's ``state()`` out of the tree (nothing reads it without a
    central critic, and mpe2's costs 100-190 µs per step); None lets the adapter probe for it.

    Raises:
        ValueError: among others, a keyword of ``kwargs`` (``--env-kwargs``) that the env does not take, named
        with the nearest one it takes where its signature tells; a value whose type is not the one the
        keyword's annotation (a bool, int, float or str) asks for.
    """
    if not isinstance(num_envs, numbers.Integral) or num_envs < 1:
        raise ValueError(f"env {name!r}: num_envs must be an int >= 1, got {num_envs!r}")
    check_values(name, kwargs or {})
    try:
        return _make_env(name, num_envs, check=check, kwargs=kwargs, shared_state=shared_state)
    except TypeError as err:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(err))
        if bad is not None and bad.group(1) in (kwargs or {}):
            from core.envsets.ids import hint

            word = bad.group(1)
            raise ValueError(f"env {name!r}: --env-kwargs {word} is not a keyword it takes"
                             f"{hint(word, parameters(name), rest_as='it takes {}')} ({err})") from None
        _blame_kwargs(name, kwargs, err)
        raise
    except (AssertionError, ValueError, KeyError, IndexError, ArithmeticError) as err:
        _blame_kwargs(name, kwargs, err)
        raise


def _blame_kwargs(name: str, kwargs: dict[str, Any] | None, err: BaseException) -> None:
    """Raises ValueError naming the env and its ``--env-kwargs`` when the env's own code refused them while
    being built (a VMAS scenario's ``assert``, a ``TypeError`` deep inside, numpy's errors: they named neither);
    returns when no keywords were given or the message names the env already. Shoal's own refusals (an
    adapter's: a space it cannot lay out, a value outside the tree) are not the keywords': they get the env's
    name in front, and keep their type."""
    if name in str(err):
        return
    if _raised_by_shoal(err):
        if isinstance(err, TypeError):  # a user error's type, as the commands tell them (user_errors)
            raise ValueError(f"env {name!r}: {err}") from None
        err.args = (f"env {name!r}: {err}", *err.args[1:])
        return
    if not kwargs:
        return
    given = " ".join(f"{k} {v!r}" for k, v in kwargs.items())
    if str(err):
        why = f"{type(err).__name__}: {err}"
    else:  # a bare ``assert``: its line says what it wanted
        import traceback

        frames = traceback.extract_tb(err.__traceback__)
        why = f"{type(err).__name__}" + (f" at `{frames[-1].line}`" if frames and frames[-1].line else "")
    raise ValueError(f"env {name!r} failed to build with --env-kwargs {given}: {why} (check the values against "
                     f"what the env accepts)") from err


def _raised_by_shoal(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is Shoal's own code (adapters/, core/, orchestration/),
    not one of its built-in envs (adapters/builtin/: their refusals are of the keywords they were given)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    here = Path(tb.tb_frame.f_code.co_filename).resolve()
    return (any(here.is_relative_to(_ROOT / part) for part in ("adapters", "core", "orchestration"))
            and not here.is_relative_to(_ROOT / "adapters" / "builtin"))


_ROOT = Path(__file__).resolve().parents[1]


def _make_env(name: str, num_envs: int, *, check: str, kwargs: dict[str, Any] | None, shared_state: bool | None):
    kwargs = dict(kwargs or {})
    if not name.strip():
        raise ValueError("no env named (--env ''): give a gymnasium id such as CartPole-v1 or one of Shoal's forms "
                         "(builtin:NAME, vmas:SCENARIO, mpe2:MODULE, pettingzoo:FAMILY.MODULE, torchrl:ID, "
                         "package.module:factory, external)")
    if name.startswith("builtin:"):
        which = name.split(":", 1)[1]
        if which == "cartpole":
            from adapters.builtin.cartpole import CartPole, CartPoleConfig

            return CartPole(CartPoleConfig(num_envs=num_envs, **kwargs))
        if which == "spread":
            from adapters.builtin.spread import Spread, SpreadConfig

            return Spread(SpreadConfig(num_envs=num_envs, **kwargs))
        if which == "spot":
            from adapters.builtin.spot import Spot, SpotConfig

            return Spot(SpotConfig(num_envs=num_envs, **kwargs))
        if which == "recall":
            from adapters.builtin.recall import Recall, RecallConfig

            return Recall(RecallConfig(num_envs=num_envs, **kwargs))
        if which == "pick":
            from adapters.builtin.pick import Pick, PickConfig

            return Pick(PickConfig(num_envs=num_envs, **kwargs))
        import difflib

        known = ["cartpole", "spread", "spot", "recall", "pick"]
        near = difflib.get_close_matches(which, known, n=1)
        raise ValueError(f"unknown built-in env {name!r}" + (f" (did you mean 'builtin:{near[0]}'?)" if near else
                         f": use one of {', '.join(f'builtin:{k}' for k in known)}"))
    if name.startswith("vmas:"):  # a VMAS scenario through torchrl's VmasEnv: the batch lives in torch
        require(name, "vmas")
        from torchrl.envs.libs.vmas import VmasEnv

        from adapters.torchrl_env import TorchRLEnv, TorchRLEnvConfig

        scenario = _vmas_scenario(name)
        payoff = kwargs.pop("payoff", "cooperative")
        seed = kwargs.pop("seed", 0)
        return TorchRLEnv(VmasEnv(scenario, num_envs=num_envs, seed=seed, **kwargs),
                          TorchRLEnvConfig(payoff=payoff))
    if name.startswith("torchrl:"):  # a gymnasium id through torchrl's own GymEnv (its vectorised batch)
        import gymnasium
        from torchrl.envs.libs.gym import GymEnv

        from adapters.torchrl_env import TorchRLEnv, TorchRLEnvConfig
        from core.envsets.ids import hint

        payoff, gym_id = kwargs.pop("payoff", "cooperative"), name.split(":", 1)[1]
        try:
            env = GymEnv(gym_id, num_envs=num_envs, **kwargs)
        except Exception:
            if gym_id in gymnasium.registry or ":" in gym_id:  # an id it knows (or module:ID): the env's own error
                raise
            raise ValueError(f"env {name!r}: torchrl:ID takes a gymnasium id, and {gym_id!r} is none"
                             f"{hint(gym_id, list(gymnasium.registry))} (e.g. torchrl:CartPole-v1)") from None
        return TorchRLEnv(env, TorchRLEnvConfig(payoff=payoff))
    if name.startswith(("mpe2:", "pettingzoo:")):
        family, module_name = name.split(":", 1)
        module = _import_pettingzoo(name, family, module_name)
        from adapters.pettingzoo_env import PettingZooAECEnv, PettingZooParallelEnv

        adapter_kwargs = {k: kwargs.pop(k) for k in ("payoff", "action_mask", "state") if k in kwargs}
        if family == "pettingzoo" and module_name.startswith("classic.") and "payoff" not in adapter_kwargs:
            # PettingZoo does not declare payoffs; its classic games are zero-sum, except the cooperative Hanabi
            adapter_kwargs["payoff"] = "cooperative" if "hanabi" in module_name else "zero_sum"
        if shared_state is False:
            adapter_kwargs.setdefault("state", False)
        if hasattr(module, "parallel_env") and not kwargs.pop("aec", False):
            return PettingZooParallelEnv(partial(module.parallel_env, **kwargs), num_envs, check=check,
                                         **adapter_kwargs)
        return PettingZooAECEnv(partial(module.env, **kwargs), num_envs, check=check, **adapter_kwargs)
    if ":" in name and (factory := factory_of(name)) is not None:
        return from_factory(name, factory, num_envs, check=check, kwargs=kwargs)
    from gymnasium.error import DependencyNotInstalled

    from adapters.gymnasium_env import make_gymnasium

    from gymnasium.error import NameNotFound

    try:
        return make_gymnasium(name, num_envs, check=check, **kwargs)
    except NameNotFound as err:
        if ":" not in name:  # a misspelt gymnasium id, or one of Shoal's forms without its prefix
            import gymnasium

            from core.envsets.ids import hint

            raise ValueError(f"env {name!r} is neither a gymnasium id{hint(name, [*gymnasium.registry, 'external'])} "
                             f"nor one of Shoal's forms (builtin:NAME, vmas:SCENARIO, mpe2:MODULE, "
                             f"pettingzoo:FAMILY.MODULE, torchrl:ID, package.module:factory, external)") from None
        # ``module:attr`` whose module has no callable ``attr`` and registers no gymnasium id ``attr``: most likely a
        # misspelled factory, so the module's callables are the nearest choices
        from core.envsets.ids import hint

        module_name, attr = name.split(":", 1)
        module = importlib.import_module(module_name)
        callables = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise ValueError(f"env {name!r}: module {module_name} has no factory {attr!r}"
                         f"{hint(attr, callables, rest_as='it has {}')}, and registers no gymnasium id {attr!r} "
                         f"({err})") from None
    except (DependencyNotInstalled, ModuleNotFoundError) as err:  # e.g. LunarLander-v3 without Box2D
        module = getattr(err, "name", None) or next((m for m in EXTRAS if m in str(err)), "")
        if extra_for(module) is None:
            raise
        raise missing_extra(name, module, extra_for(module)) from None


def _vmas_scenario(name: str) -> str:
    """The scenario of ``vmas:<scenario>`` (one of VMAS's scenario names, with or without ``.py``: VMAS loads
    scenarios from its own package only), or a ValueError naming the nearest one (VMAS itself fails an assert)."""
    import vmas

    from core.envsets.ids import hint  # imports torch: only on this path (the command's --help stays light)

    scenario = name.split(":", 1)[1]
    known = sorted({*vmas.scenarios, *vmas.debug_scenarios, *vmas.mpe_scenarios})
    if scenario.removesuffix(".py") not in known:
        raise ValueError(f"env {name!r}: unknown VMAS scenario {scenario!r}{hint(scenario, known, rest_as='VMAS has {}')}")
    return scenario


def _import_pettingzoo(name: str, family: str, module_name: str):
    """The module of ``mpe2:<name>`` or ``pettingzoo:<family>.<name>``; a missing optional package raises
    :class:`adapters.extras.MissingExtra` naming the extra that installs it, a wrong name a ValueError."""
    if family == "pettingzoo" and module_name.startswith("mpe."):  # PettingZoo 1.25 moved MPE out to mpe2
        renamed = f"mpe2:{module_name[4:]}"
        install = "" if is_installed("mpe2") else " (after pip install 'shoal[mpe2]')"
        raise ValueError(f"env {name!r}: PettingZoo's MPE environments moved to the mpe2 package; name it "
                         f"{renamed}{install}")
    if family == "mpe2":
        require(name, "mpe2")
    try:
        return importlib.import_module(f"{family}.{module_name}")
    except ModuleNotFoundError as err:
        missing = err.name or ""
        top = missing.split(".")[0]
        subfamily = family if family == "mpe2" else module_name.split(".")[0]
        if top not in (family, "") and (extra := extra_for(missing, subfamily)) is not None:
            raise missing_extra(name, missing, extra) from None
        if top not in (family, ""):  # a package of PettingZoo's own extras (chess, rlcard, ...)
            raise ImportError(f"env {name!r} needs the package {top!r}, which is not installed: pip install "
                              f"'pettingzoo[{subfamily}]' brings what PettingZoo's {subfamily} environments "
                              f"need") from None
        hint = ("PettingZoo ids are pettingzoo:<family>.<name>, e.g. pettingzoo:classic.connect_four_v3"
                if family == "pettingzoo" else "mpe2 ids are mpe2:<name>, e.g. mpe2:simple_spread_v3")
        from core.envsets.ids import hint as nearest  # imports torch: only on this path

        near = nearest(f"{family}:{module_name}", [f"{family}:{m}" for m in _modules(family)], rest_as="e.g. {}")
        raise ValueError(f"env {name!r}: no module {family}.{module_name}{near}; {hint}") from None


def _modules(package: str) -> list[str]:
    """The env modules an id of ``package`` may name, relative to it: ``simple_spread_v3`` for mpe2,
    ``classic.chess_v6`` for PettingZoo (its families' modules): what a misspelled id is compared with. Lists
    module files without importing them (a family that fails to import is skipped)."""
    root = importlib.import_module(package)
    if package == "mpe2":
        names = [m.name for m in pkgutil.iter_modules(root.__path__) if not m.ispkg]
    else:
        names = []
        for family in (m.name for m in pkgutil.iter_modules(root.__path__)
                       if m.ispkg and m.name not in ("test", "utils", "env_registry")):  # not env families
            try:
                path = importlib.import_module(f"{package}.{family}").__path__
            except Exception:  # noqa: BLE001 - a family needing a package this machine lacks: not a candidate
                continue
            names += [f"{family}.{m.name}" for m in pkgutil.iter_modules(path) if not m.ispkg]
    return [n for n in names if re.search(r"_v\d+$", n)]  # env modules are versioned: simple_spread_v3


def from_factory(name: str, factory, num_envs: int, *, check: str = "strict", kwargs: dict[str, Any] | None = None):
    """``num_envs`` envs from a user's factory: whatever it returns (a gymnasium env, a PettingZoo parallel or
    AEC env, a torchrl ``EnvBase`` that is already batched) gets the matching adapter.

    Raises:
        ValueError: the factory returns something else (named, with the types it may return).
    """
    import gymnasium

    kwargs = dict(kwargs or {})
    try:  # a keyword the factory takes itself is the factory's, even when an adapter has one of that name
        own = set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        own = set()
    adapter_kwargs = {k: kwargs.pop(k) for k in ("payoff", "action_mask", "state") if k in kwargs and k not in own}
    make = partial(factory, **kwargs)
    probe = make()
    if isinstance(probe, gymnasium.Env):
        from gymnasium.vector import SyncVectorEnv

        from adapters.gymnasium_env import GymnasiumVectorEnv

        probe.close()
        action_mask = adapter_kwargs.pop("action_mask", "auto")  # its masks: adapters.action_masks
        if adapter_kwargs:  # taken by no one: refused, not dropped
            raise ValueError(f"env {name!r}: --env-kwargs {', '.join(adapter_kwargs)} configure the PettingZoo "
                             f"adapter, and this factory returns a gymnasium env, which takes no such setting (nor "
                             f"does the factory: it takes {sorted(own) or 'no keywords'})")
        return GymnasiumVectorEnv(SyncVectorEnv([make] * num_envs), check=check, action_mask=action_mask)
    from pettingzoo import AECEnv, ParallelEnv

    if isinstance(probe, (ParallelEnv, AECEnv)):
        from adapters.pettingzoo_env import PettingZooAECEnv, PettingZooParallelEnv

        probe.close()
        cls = PettingZooParallelEnv if isinstance(probe, ParallelEnv) else PettingZooAECEnv
        return cls(make, num_envs, check=check, **adapter_kwargs)
    from torchrl.envs import EnvBase

    if isinstance(probe, EnvBase):
        from adapters.torchrl_env import TorchRLEnv, TorchRLEnvConfig

        return TorchRLEnv(probe, TorchRLEnvConfig(**adapter_kwargs))
    raise ValueError(f"env factory {name!r} returned {type(probe).__name__}; it must return a gymnasium.Env, a "
                    f"PettingZoo ParallelEnv or AECEnv, or a torchrl EnvBase")


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_GYM_ID = re.compile(r"^[A-Za-z0-9_\-/.]+$")


def imports_code(name: str) -> str | None:
    """Why building env ``name`` could import a module that ``name`` itself chooses, or None when it cannot.

    Safe forms: ``builtin:<name>``, ``torchrl:<gymnasium id>``, ``mpe2:<module>`` and ``pettingzoo:<family>.<module>`` (dotted
    identifiers inside those installed packages) and gymnasium ids without a module part (``CartPole-v1``,
    ``ALE/Pong-v5``). Gymnasium's ``module:Env-v0`` form imports ``module``: an env id read from a checkpoint
    must never do that (the checkpoint could name any module on the path).
    """
    family, sep, rest = name.partition(":")
    if not sep:
        return None if _GYM_ID.match(name) else f"env id {name!r} is not a gymnasium id"
    if family == "builtin":
        return None if rest.isidentifier() else f"built-in env {rest!r} is not a name"
    if family == "vmas":
        return None if rest.isidentifier() else f"VMAS scenario {rest!r} is not a name"
    if family in ("mpe2", "pettingzoo"):
        return None if _DOTTED.match(rest) else f"{family} module {rest!r} is not a dotted module name"
    if family == "torchrl":  # torchrl's GymEnv of a gymnasium id: safe as that id is
        return None if _GYM_ID.match(rest) else f"env id {rest!r} (through torchrl) is not a plain gymnasium id"
    return f"env {name!r} imports the module {family!r} (a module:factory, or gymnasium's module:EnvId)"


def make_run_env(config, num_envs: int):
    """``num_envs`` envs of a :class:`orchestration.config.TrainConfig`'s environment (every backend uses this);
    in ``rollout.env_processes`` subprocesses (an :class:`adapters.env_worker.EnvWorkerPool`) when asked, and
    in at least one in lenient mode or with an env timeout."""
    rc = config.rollout
    build = partial(make_env, config.env, check=rc.check, kwargs=parse_kwargs(config.env_kwargs),
                    shared_state=None if config.policy.critic != "local" else False)
    # lenient runs keep envs in a subprocess (one unless asked for more): an env that raises, returns what cannot
    # be stored (a wrong shape), hangs or dies is then restarted, its episodes truncated and counted
    processes = min(rc.env_processes or (1 if rc.env_timeout_s or rc.check == "lenient" else 0), num_envs)
    if not processes:
        return build(num_envs)
    from adapters.env_worker import EnvWorkerConfig, EnvWorkerPool

    sizes = [num_envs // processes + (k < num_envs % processes) for k in range(processes)]
    timeout = {"step_timeout_s": rc.env_timeout_s} if rc.env_timeout_s else {}
    pool_config = EnvWorkerConfig(restart=rc.check == "lenient", **timeout)  # strict: a fault stops, named
    return EnvWorkerPool([partial(build, n) for n in sizes], pool_config)


__all__ = ["from_factory", "imports_code", "make_env", "make_run_env", "parse_kwargs"]
