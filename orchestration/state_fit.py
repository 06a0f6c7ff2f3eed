"""Loading learners' states into a trainer (:func:`load_learners_`): a state of another run's config is refused
naming the policy at fault, before the trainer's counters change (a half-loaded trainer went on with the other
run's iteration and history)."""

from __future__ import annotations

from typing import Any, Mapping


def load_learners_(learners: Mapping[str, Any], states: Mapping[str, Any], keep_inbox: bool) -> None:
    """Loads ``states[pid]`` into each learner of ``learners`` (without its ``inbox`` unless ``keep_inbox``: fresh
    workers restart their sequence numbers, which an old ledger would refuse).

    Raises:
        ValueError: ``states`` holds other policies than ``learners``, or one whose state does not fit its
            learner (another env, policy sizes or mapping), naming it.
    """
    if set(states) != set(learners):
        raise ValueError(f"the state is of a run with policies {sorted(states)}, and this trainer has "
                         f"{sorted(learners)}: a state loads into a trainer built from the same config")
    for pid, learner in learners.items():
        state = {k: v for k, v in states[pid].items() if keep_inbox or k != "inbox"}
        try:
            learner.load_state_(state)
        except (RuntimeError, KeyError, ValueError) as err:
            from orchestration.run_state import shape_detail  # torch's lines of mismatches: the one that says it

            raise ValueError(f"policy {pid!r}: its state does not fit this trainer's learner (another env, network "
                             f"or mapping?); {type(err).__name__}: {shape_detail(err)}") from err


__all__ = ["load_learners_"]
