"""What a run's config, read from a checkpoint, may not do by itself: import a module or run a command.

A checkpoint is data anyone can hand over, so the settings in it that would run code are taken only when the
user names them again: an env that imports a module (``module:factory``, gymnasium's ``module:EnvId``), a
collection file (its members may be such envs; a checkpoint stores a resolved collection as a JSON document,
whose members :func:`orchestration.env_collection.load_collection` checks) and the command external
simulators are launched with. ``shoal train --resume``, ``shoal serve --resume``, ``shoal league --resume``
and ``shoal evaluate`` refuse such a checkpoint, saying which flag to give.
"""

from __future__ import annotations

import shlex
from typing import Sequence


def refuse_untrusted(saved, given: Sequence[str], command: str, *, evaluating: bool = False) -> None:
    """Raises ValueError when ``saved`` (a checkpoint's TrainConfig) would import or run code that the
    arguments ``given`` now do not name themselves; ``command`` (``shoal train --resume``, say) heads the
    way to pass it. ``evaluating``: ``shoal evaluate``, whose ``--env`` replaces the env and the collection
    (a run's ``--env`` leaves its collection, which is trained on instead) and which launches no simulator."""
    from orchestration.envs import imports_code

    named = {arg.split("=", 1)[0] for arg in given}
    if "--env" not in named and (why := imports_code(saved.env)):
        raise ValueError(f"the checkpoint names env {saved.env!r}; {why}, and an env read from a checkpoint is "
                         f"never allowed to import code. Pass the env yourself: {command} --env {saved.env} ...")
    collection = saved.collection
    replaced = "--env" in named if evaluating else "--collection" in named
    if collection and not collection.lstrip().startswith("{") and not replaced:
        way = ("name the env to play in: --env ID" if evaluating else
               f"pass it yourself: {command} --collection {shlex.quote(collection)} ...")
        raise ValueError(f"the checkpoint names the collection file {collection!r}, whose members may be envs that "
                         f"import code, and a file read from a checkpoint is never opened by itself; {way}")
    launched = saved.external.command
    if saved.env == "external" and launched and "--external.command" not in named and not evaluating:
        raise ValueError(f"the checkpoint launches its simulators with external.command {launched!r}, and a "
                         f"command read from a checkpoint is never run. Pass it yourself: {command} "
                         f"--external.command {shlex.quote(launched)} ...")


__all__ = ["refuse_untrusted"]
