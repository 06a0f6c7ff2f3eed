"""The synchronous collection rule both fleets share (orchestration.fleet.fragment_rounds)."""

from hypothesis import given
from hypothesis import strategies as st

from orchestration.fleet import fragment_rounds


@given(st.integers(-10, 10_000), st.integers(1, 64), st.integers(1, 16))
def test_rounds_deliver_the_steps_asked_with_less_than_one_round_to_spare(steps, fragment, workers):
    rounds = fragment_rounds(steps, fragment, workers)
    per_round = fragment * workers
    assert rounds * per_round >= steps and (rounds - 1) * per_round < max(steps, 1)
