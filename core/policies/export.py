"""The deployable policy: plain tensors in, the deterministic action out, exportable with ``torch.export``.

Inputs of :class:`DeployablePolicy`, all with batch ``[B, A]`` (``A`` = group capacity, fixed; ``B`` free)::

    *observation      one tensor per non-eval-only observation leaf, [B, A, *leaf.shape] in the leaf dtype,
                      in core.specs.iter_leaves order of the agent's observation node (``observation_keys``)
    action_mask=      optional [B, A, n] bool, for a single discrete / multi-discrete action leaf; for a
                      structured action a nested dict of masks keyed like the action (core.specs.structure)
    recurrent_state=  [B, A, S] the actor cell's part of the state (recurrent policies only; a recurrent
                      critic's part is not needed to act, so it is neither an input nor an output)

Output: the action (masked argmax, Gaussian mean, squashed mean, ``logit > 0``): one tensor
``[B, A, *leaf.shape]`` for a bare action leaf, else a tuple in ``action_keys`` order; a recurrent policy
appends the actor cell's next state ``[B, A, S]``. The same computation as ``GroupPolicy.act(..., deterministic=True)``.
:func:`deployment_signature` writes these inputs and outputs down (names, dtypes, shapes) for a manifest.
Critic and eval-only leaves are not part of it (notes/tensordict-hot-paths.md section 5, pattern 10: no
``torch.distributions``, a masked argmax, a dynamic batch ``Dim``). Saving to disk belongs to orchestration
(``torch.export.save(program, path)``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from core.layout import ACTION, ACTION_MASK, OBSERVATION, RECURRENT_STATE

from .actor_critic import GroupPolicy
from .recurrence import cell_step


class DeployablePolicy(nn.Module):
    """Actor-only view of a :class:`GroupPolicy` (shares its modules: later weight updates show through).

    Attributes:
        observation_keys: key path of each positional input (under the group's ``"observation"``).
        action_keys: key path of each action output (under ``"action"``).
        recurrent: whether ``recurrent_state`` is an input and the next state an output.
    """

    def __init__(self, policy: GroupPolicy) -> None:
        super().__init__()
        if policy.actor_shared_encoder is not None:
            raise ValueError(f"group {policy.group_name}: its actor reads shared observations "
                             f"{['/'.join(p) for p in policy.actor_shared_encoder.paths]}, which exported programs "
                             f"do not take yet; tag them eval_only to export the policy")
        self.encoder, self.trunk, self.cell, self.out, self.heads = (
            policy.actor_encoder, policy.actor_trunk, policy.actor_cell, policy.actor_out, policy.heads)
        self.register_buffer("agent_ids", policy.agent_ids if policy.config.agent_id_input else None,
                             persistent=False)
        self.observation_keys = list(policy.actor_encoder.paths)
        self.action_keys = list(policy.heads.paths)
        self.recurrent = policy.recurrent

    def forward(self, *observation: Tensor, action_mask: Tensor | None = None,
                recurrent_state: Tensor | None = None):
        """See the module docstring for inputs and outputs."""
        x = self.encoder(observation)
        if self.agent_ids is not None:
            x = torch.cat([x, self.agent_ids.expand(*x.shape[:-1], self.agent_ids.shape[0])], -1)
        h = self.trunk(x)
        if self.cell is not None:
            h, recurrent_state = cell_step(self.cell, h, recurrent_state)
        actions = self.heads.mode(self.out(h), action_mask)
        if self.recurrent:
            return (*actions, recurrent_state)
        return actions[0] if len(actions) == 1 else tuple(actions)


def deployable(policy: GroupPolicy) -> DeployablePolicy:
    """The tensor-in/action-out module of ``policy`` (module docstring)."""
    return DeployablePolicy(policy)


def deployment_inputs(policy: GroupPolicy, batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    """``(args, kwargs)`` for :class:`DeployablePolicy` from a group entry ``[B, A]`` (TensorDict or dict).

    ``kwargs`` holds ``action_mask`` when ``batch`` has one and, for a recurrent policy, ``recurrent_state``
    (zeros when ``batch`` has none).
    """
    args = tuple(policy.actor_encoder.read(batch[OBSERVATION]))
    kwargs = {}
    mask = batch.get(ACTION_MASK, None)
    if mask is not None:  # a tensor, or a tree of them for structured actions (core.specs.structure)
        kwargs["action_mask"] = mask if isinstance(mask, Tensor) else _plain(mask)
    if policy.recurrent:
        state = batch.get(RECURRENT_STATE, None)
        state = state if state is not None else policy.initial_state(args[0].shape[:1])
        kwargs["recurrent_state"] = policy.split_state(state)[0]
    return args, kwargs


def export_policy(policy: GroupPolicy, example_batch) -> ExportedProgram:
    """Exports :func:`deployable` ``(policy)`` with a dynamic batch dim (``Dim("batch")`` on dim 0).

    Args:
        policy: the policy (its current weights are captured).
        example_batch: a group entry ``[B, A]`` with ``"observation"`` and, if the program should take one,
            ``"action_mask"``. A batch of 1 is repeated to 2 rows first: tracing a size-1 dim would
            specialise it.

    Returns:
        The program; ``program.module()(*args, **kwargs)`` with :func:`deployment_inputs` gives the action.
    """
    args, kwargs = deployment_inputs(policy, example_batch)
    if args[0].shape[0] == 1:
        args = tuple(a.expand(2, *a.shape[1:]).clone() for a in args)
        kwargs = {k: _map(lambda v: v.expand(2, *v.shape[1:]).clone(), v) for k, v in kwargs.items()}
    batch = Dim("batch", min=1)
    dynamic_shapes = {"observation": tuple({0: batch} for _ in args),
                      **{k: _map(lambda _: {0: batch}, v) for k, v in kwargs.items()}}
    # a copy whose parameters need no gradient: the program's outputs then need none either (a caller's
    # ``action.numpy()`` works without ``torch.no_grad()``), and the live policy keeps training
    module = copy.deepcopy(deployable(policy)).eval().requires_grad_(False)
    with torch.no_grad():
        return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)


def _plain(tree) -> dict:
    """A TensorDict or mapping of tensors as nested plain dicts (what ``torch.export`` takes as an input tree)."""
    return {k: v if isinstance(v, Tensor) else _plain(v) for k, v in tree.items()}


def _map(fn, tree):
    """``fn`` applied to every tensor of a tensor or nested dict of them, in the same structure."""
    return fn(tree) if isinstance(tree, Tensor) else {k: _map(fn, v) for k, v in tree.items()}


def _named(tree, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Tensor]]:
    """``(key path, tensor)`` for every tensor of ``tree`` (``((), tree)`` for a tensor)."""
    if isinstance(tree, Tensor):
        return [(path, tree)]
    return [pair for k, v in tree.items() for pair in _named(v, (*path, k))]


def _entry(name: str, value: Tensor, **extra) -> dict:
    return {"name": name, **extra, "dtype": str(value.dtype).removeprefix("torch."),
            "shape": ["batch", *value.shape[1:]]}


def leaf_name(root: str, path: tuple[str, ...]) -> str:
    """``"observation"`` for a bare leaf, ``"observation/pos"`` for a dict leaf (``root`` + key path)."""
    return "/".join((root, *path))


def deployment_signature(policy: GroupPolicy, example_batch) -> dict:
    """The inputs and outputs of :func:`export_policy` ``(policy, example_batch)``'s program, JSON-ready.

    Every tensor is described by ``name``, ``dtype`` (torch name without ``torch.``) and ``shape``: the
    dynamic batch dim as ``"batch"``, then the group capacity ``A`` (every slot of the group, fixed), then the
    leaf's shape. Inputs carry ``kind``: ``"positional"`` (with ``position``) for observation leaves, named
    ``"observation"`` / ``"observation/<key path>"``, or ``"keyword"`` (``required``: the program is traced
    with it and rejects a call without it) for ``action_mask`` (when ``example_batch`` has one; all True
    allows every action) and ``recurrent_state``, with ``keyword`` (the argument's name) and ``path`` (the key
    path inside it: ``[]`` for a tensor; a structured action's masks are one nested dict,
    ``action_mask={"node": ..., "@present": {...}}``, named ``action_mask/node``, ...). Outputs are named
    ``"action"`` / ``"action/<key path>"``, then ``"recurrent_state"`` (the next state) for a recurrent policy;
    ``returns`` says whether the program gives one tensor or a tuple in that order.

    Args:
        policy: the policy; example_batch: a group entry ``[B, A]`` as for :func:`export_policy`.
    """
    args, kwargs = deployment_inputs(policy, example_batch)
    module = deployable(policy).eval()
    with torch.no_grad():
        out = module(*args, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    inputs = [_entry(leaf_name(OBSERVATION, path), a, kind="positional", position=i)
              for i, (path, a) in enumerate(zip(module.observation_keys, args))]
    inputs += [_entry("/".join((name, *path)), v, kind="keyword", keyword=name, path=list(path), required=True)
               for name, tree in kwargs.items() for path, v in _named(tree)]
    names = [leaf_name(ACTION, path) for path in module.action_keys] + ([RECURRENT_STATE] if module.recurrent else [])
    return {"inputs": inputs, "outputs": [_entry(name, v) for name, v in zip(names, outs)],
            "returns": "tuple" if isinstance(out, tuple) else "tensor"}


__all__ = ["DeployablePolicy", "deployable", "deployment_inputs", "deployment_signature", "export_policy", "leaf_name"]
