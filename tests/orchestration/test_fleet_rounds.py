"""The synchronous collection rule both fleets share (orchestration.fleet.fragment_rounds)."""

from hypothesis import given
from hypothesis import strategies as st

from orchestration.fleet import collect_in_rounds, fragment_rounds


@given(st.integers(-10, 10_000), st.integers(1, 64), st.integers(1, 16))
def test_rounds_deliver_the_steps_asked_with_less_than_one_round_to_spare(steps, fragment, workers):
    rounds = fragment_rounds(steps, fragment, workers)
    per_round = fragment * workers
    assert rounds * per_round >= steps and (rounds - 1) * per_round < max(steps, 1)


@given(st.integers(1, 5_000), st.integers(1, 64), st.integers(1, 8), st.lists(st.integers(0, 7), max_size=6),
       st.integers(1, 6))
def test_a_collection_tops_up_what_dead_workers_lost_and_gives_up_after_its_attempts(
        steps, fragment, workers, deaths, attempts):
    """A fake fleet: at each collection the worker named next in ``deaths`` (if there is one by that index) dies
    and delivers nothing; the learners hold what the others delivered."""
    deaths = iter(deaths)
    held, calls, delivered = [0], [], []

    def run_rounds(rounds: dict[int, int]) -> list[dict]:
        calls.append((held[0], dict(rounds)))
        dead = next(deaths, None)
        held[0] += sum(k * fragment for w, k in rounds.items() if w != dead)
        now = [{"worker": w, "call": len(calls)} for w, k in rounds.items() if k and w != dead]
        delivered.extend(now)
        return now

    try:
        reports = collect_in_rounds(steps, fragment, workers, run_rounds, lambda: held[0], attempts)
    except RuntimeError as error:  # short after every attempt: says by how much
        assert len(calls) == attempts and held[0] < steps
        assert f"{steps - held[0]} env steps short" in str(error)
    else:
        assert held[0] >= steps and len(calls) <= attempts
        assert reports == delivered  # every collection's reports, each once
    for before, rounds in calls:  # every worker asked the same rounds: what the shortfall needs, no more
        assert rounds == dict.fromkeys(range(workers), fragment_rounds(steps - before, fragment, workers))


def test_without_learners_one_collection_is_all():
    asked = []
    collect_in_rounds(100, 10, 3, lambda rounds: asked.append(rounds) or [], None, attempts=5)
    assert asked == [{0: 4, 1: 4, 2: 4}]
