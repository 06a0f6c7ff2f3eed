"""Fragment assembly: stacking, metadata, bootstrap consistency and episode ids across random episode ends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.buffers import FragmentBuilder, bootstrap_step, time_slots
from core.layout import (
    DONE, ENV_ID, EPISODE_ID, FRAGMENT_ID, MASK, NEXT, OBSERVATION, POLICY_VERSION, REWARD, TERMINATED,
    TRUNCATED, WORKER_ID, make_fragment_id,
)
from tests.strategies import GROUP, StepStream, step_streams


def run_stream(stream: StepStream, worker_id: int = 7) -> tuple[FragmentBuilder, list]:
    builder = FragmentBuilder(stream.num_envs, worker_id=worker_id)
    fragments = []
    for k in range(stream.num_fragments):
        for step in stream.steps[k * stream.fragment_length:(k + 1) * stream.fragment_length]:
            builder.add_step_(step)
        fragments.append(builder.build({GROUP: 100 + k}))
    return builder, fragments


@given(stream=step_streams())
def test_fragments_stack_the_steps_with_group_batch_sizes(stream):
    _, fragments = run_stream(stream)
    e, a, t = stream.num_envs, stream.num_agents, stream.fragment_length
    for k, frag in enumerate(fragments):
        assert tuple(frag.batch_size) == (e, t)
        assert tuple(frag[GROUP].batch_size) == (e, t, a) == tuple(frag[NEXT, GROUP].batch_size)
        for j in range(t):
            step = stream.steps[k * t + j]
            assert torch.equal(frag[GROUP, OBSERVATION][:, j], step[GROUP][OBSERVATION])
            assert torch.equal(frag[NEXT, GROUP, REWARD][:, j], step[NEXT][GROUP][REWARD])
            assert torch.equal(frag[NEXT, DONE][:, j], step[NEXT][DONE])
        # metadata: constant along time (except episode ids), traceable to worker, fragment, env, policy
        assert torch.equal(frag[POLICY_VERSION, GROUP], torch.full((e, t), 100 + k))
        assert torch.equal(frag[WORKER_ID], torch.full((e, t), 7))
        assert torch.equal(frag[FRAGMENT_ID], torch.full((e, t), make_fragment_id(7, k)))
        assert torch.equal(frag[ENV_ID], torch.arange(e).unsqueeze(1).expand(e, t))
        # the recurrent state rides along at every step; the fragment's initial state is step 0's
        assert torch.equal(frag[GROUP, "recurrent_state"][:, 0], stream.steps[k * t][GROUP]["recurrent_state"])


@given(stream=step_streams())
def test_next_observation_and_bootstrap_are_consistent_across_fragments(stream):
    _, fragments = run_stream(stream)
    whole = torch.cat(fragments, dim=1)  # [E, N]: consecutive fragments of each env, joined along time
    obs, nxt = whole[GROUP, OBSERVATION][..., 0, 0], whole[NEXT, GROUP, OBSERVATION][..., 0, 0]  # [E, N]
    done = whole[NEXT, DONE].squeeze(-1)
    for env in range(stream.num_envs):
        for t in range(nxt.shape[1]):
            assert nxt[env, t] == stream.final[env][t]
            if t + 1 < nxt.shape[1]:
                # next obs is the following obs unless the episode ended (then the env reset to a fresh id)
                assert (nxt[env, t] == obs[env, t + 1]) == (not done[env, t])
    for k in range(len(fragments) - 1):
        boot = bootstrap_step(fragments[k])
        assert tuple(boot[GROUP].batch_size) == (stream.num_envs, stream.num_agents)
        cont = ~fragments[k][NEXT, DONE][:, -1, 0]
        first = fragments[k + 1][GROUP, OBSERVATION][:, 0]
        # continuing episodes bootstrap from the next fragment's first observation; ended ones do not
        same = (boot[GROUP, OBSERVATION] == first).all(-1).all(-1)  # [E]
        assert torch.equal(same, cont)


@given(stream=step_streams())
def test_boundary_sets_no_flag_and_episode_ids_change_exactly_at_dones(stream):
    _, fragments = run_stream(stream)
    whole = torch.cat(fragments, dim=1)
    e = stream.num_envs
    # flags are exactly the env's: a fragment boundary is not an episode end
    assert whole[NEXT, DONE].squeeze(-1).tolist() == stream.done
    assert whole[NEXT, TRUNCATED].squeeze(-1).tolist() == stream.truncated
    ids = whole[EPISODE_ID]
    assert torch.equal(ids[:, 0], torch.arange(e))
    step = ids[:, 1:] - ids[:, :-1]
    assert torch.equal(step, e * whole[NEXT, DONE].squeeze(-1)[:, :-1].long())
    # unique per worker: an id never appears in two envs
    for env in range(e):
        assert torch.all(ids[env] % e == env)


def make_step(e=2, a=3, value=0.0, **extra):
    step = {GROUP: {OBSERVATION: torch.full((e, a, 4), value), MASK: torch.ones(e, a, dtype=torch.bool)},
            NEXT: {GROUP: {REWARD: torch.ones(e, a, 1)}, DONE: torch.zeros(e, 1, dtype=torch.bool),
                   TRUNCATED: torch.zeros(e, 1, dtype=torch.bool)}}
    step[GROUP].update(extra)
    return step


def test_a_step_with_different_keys_is_refused_and_not_half_added():
    builder = FragmentBuilder(2)
    builder.add_step_(make_step())
    with pytest.raises(KeyError, match="recurrent_state"):
        builder.add_step_(make_step(recurrent_state=torch.zeros(2, 3, 1)))
    bad = make_step()
    del bad[NEXT][GROUP][REWARD]
    with pytest.raises(KeyError, match="reward"):
        builder.add_step_(bad)
    builder.add_step_(make_step(value=1.0))
    frag = builder.build(0)
    assert frag.batch_size == (2, 2) and frag[GROUP, OBSERVATION][:, 1].eq(1.0).all()


def test_shape_errors_name_the_key():
    with pytest.raises(ValueError, match="observation"):
        FragmentBuilder(3).add_step_(make_step(e=2))
    with pytest.raises(ValueError, match=r"observation.*expected \[2, 4"):
        FragmentBuilder(2, group_sizes={GROUP: 4}).add_step_(make_step())
    builder = FragmentBuilder(2)
    builder.add_step_(make_step())
    step = make_step()
    step[GROUP][OBSERVATION] = torch.zeros(2, 3, 5)
    builder.add_step_(step)
    with pytest.raises(ValueError, match="observation"):
        builder.build(0)
    with pytest.raises(KeyError, match="done"):
        FragmentBuilder(2).add_step_({GROUP: {OBSERVATION: torch.zeros(2, 3)}, NEXT: {}})
    with pytest.raises(KeyError, match="episode_id"):
        FragmentBuilder(2).add_step_({**make_step(), EPISODE_ID: torch.zeros(2)})


def test_peek_and_clear_leave_sequence_and_episode_ids_alone():
    builder = FragmentBuilder(2, worker_id=1)
    builder.add_step_(make_step())
    assert builder.peek().batch_size == (2, 1) and len(builder) == 1
    builder.clear_()
    assert len(builder) == 0
    builder.add_step_(make_step(value=2.0))
    frag = builder.build(1)
    assert frag[FRAGMENT_ID][0, 0] == make_fragment_id(1, 0) and frag[GROUP, OBSERVATION].eq(2.0).all()
    assert builder.sequence == 1


def test_end_episodes_truncates_only_the_named_envs_that_are_not_done():
    builder = FragmentBuilder(3)
    for done_last in (False, True):
        step = make_step(e=3)
        step[NEXT][DONE] = torch.tensor([[False], [done_last], [False]])
        step[NEXT][GROUP][DONE] = step[NEXT][DONE].unsqueeze(1).expand(3, 3, 1).clone()
        step[NEXT][GROUP][TRUNCATED] = torch.zeros(3, 3, 1, dtype=torch.bool)
        builder.add_step_(step)
    frag = builder.build(0, end_episodes=torch.tensor([True, True, False]))
    assert frag[NEXT, DONE][:, -1, 0].tolist() == [True, True, False]
    assert frag[NEXT, TRUNCATED][:, -1, 0].tolist() == [True, False, False]  # env 1 had really ended
    assert frag[NEXT, GROUP, TRUNCATED][:, -1, :, 0].tolist() == [[True] * 3, [False] * 3, [False] * 3]
    assert frag[NEXT, DONE][:, 0, 0].tolist() == [False] * 3  # earlier steps untouched
    assert len(builder) == 0 and builder.tracker.episode_count.tolist() == [1, 1, 0]


def test_policy_version_per_group_must_cover_every_group():
    builder = FragmentBuilder(2)
    builder.add_step_(make_step())
    with pytest.raises(KeyError, match=GROUP):
        builder.build({"other": 1})
    assert builder.build({GROUP: 4})[POLICY_VERSION, GROUP].eq(4).all()


@pytest.mark.slow  # the torchrl import alone takes 4-8 s on the shared CPU machine
@given(stream=step_streams(max_fragments=3))
def test_gae_bootstraps_at_a_fragment_boundary_without_a_flag(stream):
    # TD(0) advantages per fragment equal those of the unbroken stream: the last step of a fragment
    # bootstraps from the critic at ("next", obs) unless terminated, with no flag set at the boundary
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    def td0(rollout):
        value = rollout[GROUP, OBSERVATION][..., :1] * 0.01  # a fixed "critic" of the observation id
        next_value = rollout[NEXT, GROUP, OBSERVATION][..., :1] * 0.01
        nxt = rollout[NEXT, GROUP]
        adv, _ = generalized_advantage_estimate(0.9, 0.0, value, next_value, nxt[REWARD], nxt[DONE],
                                                nxt[TERMINATED], time_dim=1)
        return adv

    _, fragments = run_stream(stream)
    joined = torch.cat([td0(f) for f in fragments], dim=1)
    torch.testing.assert_close(joined, td0(torch.cat(fragments, dim=1)))
    last = fragments[0]
    expected = last[NEXT, GROUP, REWARD][:, -1] + 0.9 * bootstrap_step(last)[GROUP, OBSERVATION][..., :1] * 0.01 * (
        ~last[NEXT, GROUP, TERMINATED][:, -1]) - last[GROUP, OBSERVATION][:, -1, :, :1] * 0.01
    torch.testing.assert_close(td0(last)[:, -1], expected)


def test_a_tensor_shared_by_every_step_is_stacked_as_a_copy():
    # Envs hand one constant tensor to every step (masks, flags); the fragment must equal a plain stack and
    # own its memory: writing into it (as the episode-end cut does) leaves the env's tensor untouched.
    builder = FragmentBuilder(2)
    constant = torch.zeros(2, 1, dtype=torch.bool)
    for t in (1, 3):  # one step, then several
        for _ in range(t):
            builder.add_step_({GROUP: {OBSERVATION: torch.rand(2, 1, 3)}, NEXT: {DONE: constant}})
        fragment = builder.build({GROUP: 0})
        done = fragment.get((NEXT, DONE))
        assert torch.equal(done, torch.stack([constant] * t, 1))
        done.fill_(True)
        assert not constant.any()


@given(stream=step_streams(), capacity=st.integers(1, 6), late=st.integers(0, 3))
def test_preallocated_storage_builds_the_same_fragments_as_stacking(stream, capacity, late):
    """Every leaf in TimeSlots (the size threshold set to 0): the same fragments, bit for bit, whether a fragment
    is shorter than the storage, fills it, or outgrows it (``late`` more steps); the steps are not held after
    a build."""
    listed, slotted = FragmentBuilder(stream.num_envs), FragmentBuilder(stream.num_envs, fragment_length=capacity)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time_slots, "PREALLOCATE_BYTES", 0)
        steps, start = stream.steps, 0
        while start < len(steps):
            chunk = steps[start:start + capacity + late]
            for step in chunk:
                listed.add_step_(step)
                slotted.add_step_(step)
            start += len(chunk)
            expected, got = listed.build({GROUP: 3}), slotted.build({GROUP: 3})
            assert set(expected.keys(True, True)) == set(got.keys(True, True))
            for key, value in expected.items(True, True):
                assert torch.equal(value, got.get(key)), key
                assert got.get(key).is_contiguous(), key
            assert len(slotted) == 0


def test_preallocated_storage_names_a_key_whose_shape_changes():
    slots = time_slots.TimeSlots(("agents", "observation"), capacity=4)
    slots.append(torch.zeros(3, 2, 5))
    with pytest.raises(ValueError, match=r"\('agents', 'observation'\).*step 1"):
        slots.append(torch.zeros(3, 2, 6))
    with pytest.raises(TypeError, match="observation"):
        slots.append([1.0])
    assert len(slots) == 1 and torch.equal(slots.stacked(consume=True), torch.zeros(3, 1, 2, 5))


def test_time_major_storage_is_dropped_when_its_leaf_is_stacked():
    """At a fragment boundary each small-row leaf's time-major storage goes as soon as that leaf is transposed,
    so the boundary holds one leaf twice over, not every leaf (``benchmarks/transition_memory.py``)."""
    slots = time_slots.TimeSlots(("next", "done"), capacity=4)
    for _ in range(4):
        slots.append(torch.ones(3, 1, dtype=torch.bool))  # 1 byte per env: stored time-major
    kept = slots.stacked(consume=False)
    assert len(slots) == 4  # a peek keeps the steps
    taken = slots.stacked(consume=True)
    assert torch.equal(kept, taken) and taken.shape == (3, 4, 1)
    with pytest.raises(ValueError, match="no steps"):
        slots.stacked(consume=True)  # the storage went with the consuming stack, before clear()


@given(reuse=st.lists(st.booleans(), min_size=1, max_size=9), capacity=st.integers(1, 4),
       row=st.sampled_from([(1,), (2, 3)]), keep=st.integers(0, 9), consume=st.booleans())
def test_slots_of_a_leaf_that_repeats_its_first_tensor_stack_like_a_list(reuse, capacity, row, keep, consume):
    """Steps that hand in the first step's tensor object again (constant masks and flags) are stored without a
    copy until a step differs; whatever the pattern, the storage outgrowing its capacity, or a truncation, the
    stack equals ``torch.stack`` of the steps, is contiguous and never aliases a step's tensor."""
    first = torch.arange(3 * torch.Size(row).numel(), dtype=torch.float32).reshape(3, *row)
    steps = [first if same or i == 0 else first + i for i, same in enumerate(reuse)]
    slots = time_slots.TimeSlots(("next", "done"), capacity=capacity)
    for step in steps:
        slots.append(step)
    slots.truncate_(keep)
    kept = steps[:keep]
    if not kept:
        with pytest.raises(ValueError, match="no steps"):
            slots.stacked(consume)
        return
    got = slots.stacked(consume)
    assert torch.equal(got, torch.stack(kept, 1)) and got.is_contiguous()
    got.fill_(-1)
    assert torch.equal(first, torch.arange(first.numel(), dtype=torch.float32).reshape(first.shape))
    assert len(slots) == (0 if consume else len(kept))


@given(stream=step_streams(), pick=st.randoms(use_true_random=False))
def test_episodes_marked_cut_are_left_out_of_the_completed_ones(stream, pick):
    """A random half of the episode ends marked cut (``mark_cut_`` after their step; the adapters say which env
    counter counts them): the completed records are exactly the unmarked ends', in order."""
    plain, cut = FragmentBuilder(stream.num_envs, worker_id=7), FragmentBuilder(stream.num_envs, worker_id=7)
    marked = set()
    for k in range(stream.num_fragments):
        for j, step in enumerate(stream.steps[k * stream.fragment_length:(k + 1) * stream.fragment_length]):
            plain.add_step_(step)
            cut.add_step_(step)
            t = k * stream.fragment_length + j
            rows = [e for e in range(stream.num_envs) if stream.done[e][t] and pick.random() < 0.5]
            if rows:
                cut.mark_cut_(rows)
                marked |= {(e, t) for e in rows}
        plain.build({GROUP: k})
        cut.build({GROUP: k})
    every, kept = plain.pop_completed_episodes(), cut.pop_completed_episodes()
    if not every:
        return
    ends = [(int(e), int(f) * stream.fragment_length + int(t)) for e, f, t in zip(
        every[GROUP][ENV_ID], every[GROUP][FRAGMENT_ID] & 0xFFFFFFFF, every[GROUP]["end_time"])]
    keep = torch.tensor([end not in marked for end in ends], dtype=torch.bool)
    assert torch.equal(kept[GROUP]["agent_return"], every[GROUP]["agent_return"][keep])
    assert torch.equal(kept[GROUP][EPISODE_ID], every[GROUP][EPISODE_ID][keep])
