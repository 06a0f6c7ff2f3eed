"""An inbox's saved ledger says what a restored one holds: its pool is not saved, so what waited there untrained
is lost, never accepted (a local asynchronous resume counted it accepted for the rest of the run)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from orchestration.inbox import ACCEPTED, LOST, STALE, Inbox

FRAGMENT = TensorDict(x=torch.zeros(2, 2), batch_size=[2, 2])  # 4 env steps


@given(plan=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.booleans()), min_size=1, max_size=30),
       reuse_limit=st.integers(1, 3), max_staleness=st.none() | st.integers(0, 2))
def test_a_restored_inbox_counts_the_pools_untrained_fragments_lost(plan, reuse_limit, max_staleness):
    """``plan``: per delivery (worker, versions it lags, whether a training step follows it)."""
    inbox = Inbox("p", batch_steps=8, max_staleness=max_staleness, reuse_limit=reuse_limit)
    version, sequences = 3, {}
    for fid, (worker, lag, train) in enumerate(plan):
        sequences[worker] = sequences.get(worker, -1) + 1
        meta = {"fragment_id": fid, "worker_id": worker, "sequence": sequences[worker],
                "policy_versions": {"p": version - lag}}
        assert inbox.announce(meta)
        inbox.add(FRAGMENT, meta, version)
        if train and inbox.ready(version):
            inbox.take(version, take_all=False)
            version += 1
    before = inbox.report()["totals"]
    untrained = inbox.report()["pending_fragments"]  # stale ones were already dropped by ready()/take()
    restored = Inbox("p", batch_steps=8, max_staleness=max_staleness, reuse_limit=reuse_limit)
    restored.load_state_(inbox.state())
    after = restored.report()["totals"]
    assert after == {ACCEPTED: before[ACCEPTED] - untrained, STALE: before[STALE], LOST: before[LOST] + untrained}
    assert after[ACCEPTED] == inbox.counters["trained_fragments"] and sum(after.values()) == len(plan)
    assert inbox.report()["totals"] == before  # the live inbox keeps its pool and counts
