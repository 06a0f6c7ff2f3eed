"""Environment collections (core.envsets): curriculum promotion as properties, split and collection errors, and
the lossless JSON form (the adversarial sampler and the priors: test_env_sampling.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.envsets import (
    AdversarialSet, Choice, CollectionError, Curriculum, CurriculumState, EnvCollection, EnvMember, Normal,
    PriorDistribution, Split, Uniform, find_cycle, from_json, to_json,
)
from core.envsets.curriculum import REQUIRES

def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def dags(draw, max_nodes: int = 6):
    """``(stages, edges)``: a random DAG (edges follow a hidden random topological order; stages are shuffled)."""
    k = draw(st.integers(1, max_nodes), label="stages")
    names = [f"env{i}" for i in range(k)]
    topo = draw(st.permutations(names))
    pairs = [(topo[i], topo[j]) for i in range(k) for j in range(i + 1, k)]
    keep = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    return tuple(draw(st.permutations(names))), tuple(p for p, kept in zip(pairs, keep) if kept)


@given(dag=dags(), require=st.sampled_from(REQUIRES), threshold=st.floats(-10, 10), data=st.data())
def test_promotion_happens_exactly_when_the_threshold_is_met_and_never_before(dag, require, threshold, data):
    stages, edges = dag
    curriculum = Curriculum(stages=stages, edges=edges, metric="score", threshold=threshold, require=require)
    preds = {s: [a for a, b in edges if b == s] for s in stages}
    levels = [threshold - 1, math.nextafter(threshold, -math.inf), threshold, threshold + 1, math.nan]
    reports = data.draw(st.lists(st.dictionaries(st.sampled_from(stages), st.sampled_from(range(len(levels)))),
                                 max_size=8), label="reports")
    quantifier = all if require == "all" else any
    state = curriculum.initial_state()
    assert state.unlocked == {s for s in stages if not preds[s]} and not state.mastered
    witnessed: set[str] = set()  # envs that met the threshold in a report while unlocked
    for report in reports:
        metrics = {env: {"score": levels[i], "other": -1e9} for env, i in report.items()}
        witnessed |= {env for env, i in report.items() if env in state.unlocked and levels[i] >= threshold}
        new = curriculum.promote(state, metrics)
        assert state.unlocked <= new.unlocked and state.mastered <= new.mastered  # monotone
        assert new.mastered == witnessed
        for s in stages:  # unlocked iff a root or its predecessors have met the threshold (never before)
            assert (s in new.unlocked) == (not preds[s] or quantifier(p in witnessed for p in preds[s])), s
        assert set(curriculum.draw(new, 16, _gen())) <= new.unlocked
        state = new


def test_a_rising_metric_promotes_at_the_first_report_that_meets_the_threshold():
    curriculum = Curriculum(stages=("easy", "hard"), edges=(("easy", "hard"),), metric="mean_return", threshold=0.9)
    state = curriculum.initial_state()
    for value in (0.1, 0.5, math.nextafter(0.9, 0.0), math.nan):
        state = curriculum.promote(state, {"easy": {"mean_return": value}})
        assert state.unlocked == {"easy"}
    state = curriculum.promote(state, {"easy": {"mean_return": 0.9}})
    assert state.unlocked == {"easy", "hard"}
    state = curriculum.promote(state, {"easy": {"mean_return": 0.0}})  # a later drop never re-locks
    assert state.unlocked == {"easy", "hard"} and curriculum.training_ids(state) == ("easy", "hard")


def test_metrics_of_locked_envs_never_promote_and_promotion_does_not_cascade_in_one_call():
    curriculum = Curriculum(stages=("a", "b", "c"), edges=(("a", "b"), ("b", "c")), metric="m", threshold=1.0)
    state = curriculum.promote(curriculum.initial_state(), {"a": {"m": 5.0}, "b": {"m": 5.0}, "c": {"m": 5.0}})
    assert state == CurriculumState(unlocked=frozenset({"a", "b"}), mastered=frozenset({"a"}))
    state = curriculum.promote(state, {"b": {"m": 5.0}})
    assert state.unlocked == {"a", "b", "c"}


def test_require_all_waits_for_every_predecessor_and_any_for_one():
    edges = (("a", "c"), ("b", "c"))
    for require, expected in (("all", {"a", "b"}), ("any", {"a", "b", "c"})):
        curriculum = Curriculum(stages=("a", "b", "c"), edges=edges, metric="m", threshold=0.0, require=require)
        state = curriculum.promote(curriculum.initial_state(), {"a": {"m": 0.0}})
        assert state.unlocked == expected, require
        assert curriculum.promote(state, {"b": {"m": 0.0}}).unlocked == {"a", "b", "c"}


@given(dag=dags(max_nodes=5), data=st.data())
def test_an_edge_against_the_order_is_refused_with_its_cycle_named(dag, data):
    stages, edges = dag
    assert find_cycle(stages, edges) is None
    if not edges:
        return
    a, b = data.draw(st.sampled_from(edges), label="reversed edge")
    with pytest.raises(CollectionError, match="cycle") as err:
        Curriculum(stages=stages, edges=edges + ((b, a),), metric="m", threshold=0.0)
    cycle = str(err.value).split("cycle ")[1].split(";")[0].split(" -> ")
    assert cycle[0] == cycle[-1] and len(cycle) >= 3
    assert all(pair in set(edges) | {(b, a)} for pair in zip(cycle, cycle[1:]))  # a real cycle of the graph


def test_a_self_loop_is_a_cycle():
    with pytest.raises(CollectionError, match="cycle x -> x"):
        Curriculum(stages=("x",), edges=(("x", "x"),), metric="m", threshold=0.0)


# ----------------------------------------------------------------------------------------- splits, collections


def test_a_split_trains_only_on_train_envs_and_evaluates_only_on_test_envs():
    split = Split(train=("a", "b"), test=("c",))
    collection = EnvCollection(members={"a": "A", "b": "B", "c": "C"}, structure=split)
    draws = collection.draw(collection.initial_state(), 400, _gen(7))
    assert set(draws) == {"a", "b"}
    assert collection.training_ids() == ("a", "b") and collection.evaluation_ids() == ("c",)
    assert draws == collection.draw(None, 400, _gen(7))  # deterministic given the generator


@pytest.mark.parametrize("train, test, where, needle", [
    (("a", "b"), ("b",), "split.test[0]", "'b' is also in split.train"),
    ((), ("b",), "split.train", "at least one"),
    (("a",), (), "split.test", "at least one"),
    (("a", "a"), ("b",), "split.train[1]", "'a' is listed twice"),
    ("a", ("b",), "split.train", "expected a list"),
])
def test_split_errors_name_the_field_and_the_env(train, test, where, needle):
    with pytest.raises(CollectionError, match=needle) as err:
        Split(train=train, test=test)
    assert err.value.where == where


def test_structures_pick_their_training_and_evaluation_envs():
    members = {"a": "A", "b": "B", "c": "C"}
    curriculum = EnvCollection(members=members, structure=Curriculum(stages=("a", "b", "c"), edges=(("a", "b"),),
                                                                     metric="m", threshold=1.0))
    state = curriculum.initial_state()
    assert curriculum.training_ids(state) == ("a", "c") and curriculum.evaluation_ids() == ("a", "b", "c")
    assert curriculum.training_ids(curriculum.update(state, {"a": {"m": 1.0}})) == ("a", "b", "c")
    adversarial = EnvCollection(members=members, structure=AdversarialSet(ids=("a", "b", "c")))
    assert adversarial.training_ids(adversarial.initial_state()) == adversarial.evaluation_ids() == ("a", "b", "c")
    single = EnvCollection(members={"only": EnvMember(env="CartPole-v1", kwargs={"max_steps": 200})})
    assert single.training_ids() == single.evaluation_ids() == ("only",) and single.sample_params(3, _gen()) == {}


def test_member_kwargs_are_a_frozen_copy():
    kwargs = {"size": [5, 5], "walls": {"density": 0.2}}
    member = EnvMember(env="Maze-v0", kwargs=kwargs)
    kwargs["size"].append(6)
    kwargs["walls"]["density"] = 0.9
    assert member.kwargs["size"] == (5, 5) and member.kwargs["walls"]["density"] == 0.2
    with pytest.raises(TypeError):
        member.kwargs["size"] = 3  # type: ignore[index]
    with pytest.raises(CollectionError, match=r"member.kwargs.seed: expected a finite number"):
        EnvMember(env="Maze-v0", kwargs={"seed": math.nan})


def test_several_envs_without_a_structure_are_refused_with_the_structures_listed():
    with pytest.raises(CollectionError, match="Split, Curriculum, AdversarialSet, PriorDistribution"):
        EnvCollection(members={"a": "A", "b": "B"})


@pytest.mark.parametrize("build, where, needle", [
    (lambda: EnvCollection(members={"cartpole": "C", "maze": "M"}, structure=Split(train=("cartpol",),
                                                                                    test=("maze",))),
     "structure (Split)", "'cartpol' is not a member (did you mean 'cartpole'?)"),
    (lambda: EnvCollection(members={"a": "A", "b": "B", "extra": "E"}, structure=Split(train=("a",), test=("b",))),
     "members['extra']", "'extra' is not used by the Split"),
    (lambda: Curriculum(stages=("cartpole", "maze"), edges=(("cartpol", "maze"),), metric="m", threshold=0),
     "curriculum.edges[0]", "unknown env id 'cartpol' (did you mean 'cartpole'?)"),
    (lambda: Curriculum(stages=("a",), metric="m", threshold=0, require="al"),
     "curriculum.require", "did you mean 'all'?"),
    (lambda: Curriculum(stages=("a",), metric="m", threshold=math.inf), "curriculum.threshold", "finite"),
    (lambda: Curriculum(stages=("easy", "hard"), metric="m", threshold=0).promote(
        CurriculumState(unlocked=frozenset({"easy"})), {"hardd": {"m": 1.0}}),
     "metrics_by_env['hardd']", "did you mean 'hard'?"),
    (lambda: Curriculum(stages=("a",), metric="mean_return", threshold=0).promote(
        CurriculumState(unlocked=frozenset({"a"})), {"a": {"mean_retrun": 1.0}}),
     "metrics_by_env['a']", "no metric 'mean_return' (curriculum.metric) (closest reported: 'mean_retrun')"),
    (lambda: AdversarialSet(ids=("a",), temperature=0.0), "adversarial.temperature", "> 0"),
    (lambda: AdversarialSet(ids=("left", "right")).draw({"lefft": 1.0}, 1, _gen()),
     "returns_by_env['lefft']", "did you mean 'left'?"),
    (lambda: PriorDistribution(id="p", params={"g": Uniform(low=1.0, high=1.0)}), "uniform.high", "> low"),
    (lambda: PriorDistribution(id="p", params={"g": Choice(values=(1, 2), probs=(0.5, 0.6))}), "choice.probs",
     "sum to 1"),
    (lambda: PriorDistribution(id="p", params={"g": 3.0}), "prior.params['g']", "Uniform, Normal, Choice"),
    (lambda: PriorDistribution(id="p", params={"gravity": Uniform(low=0, high=1)}).param("gravty"), "name",
     "did you mean 'gravity'?"),
    (lambda: EnvCollection(members={"bad id": "A"}), "members['bad id']", "letters, digits"),
    (lambda: EnvCollection(members={"maze": ""}), "members['maze'].env", "non-empty env name"),
    (lambda: from_json(json.dumps({"format": "shoal.envcollection/1", "structure": None, "members": {
        "maze": {"env": "Maze-v0", "kwargs": {"size": [1, {"k": math.inf}]}}}})),
     "members['maze'].kwargs.size[1].k", "finite"),
    (lambda: EnvCollection(members={"a": "A", "b": "B"}, structure=Split(train=("a",), test=("b",))).member("bb"),
     "env_id", "did you mean 'b'?"),
])
def test_errors_name_the_field_and_the_bad_id_and_suggest_the_nearest(build, where, needle):
    with pytest.raises(CollectionError) as err:
        build()
    assert err.value.where == where and needle in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------------------- JSON

ids_ = st.text(alphabet="abcxyz019_-.", min_size=1, max_size=5)
finite = st.floats(-1e6, 1e6, allow_nan=False)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-10**9, 10**9) | finite | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8)


@st.composite
def distributions(draw):
    kind = draw(st.sampled_from(("uniform", "normal", "choice")))
    low, width = draw(finite), draw(st.floats(1e-3, 1e3))
    if kind == "uniform":
        return Uniform(low=low, high=low + width)
    if kind == "normal":
        return Normal(mean=low, std=width, clip=draw(st.none() | st.just((low - width, low + width))))
    values = draw(st.lists(st.integers(-99, 99), min_size=1, max_size=4, unique=True)
                  | st.lists(finite, min_size=1, max_size=4, unique=True))
    weights = draw(st.none() | st.lists(st.floats(0.01, 1), min_size=len(values), max_size=len(values)))
    return Choice(values=values, probs=None if weights is None else [w / sum(weights) for w in weights])


@st.composite
def collections(draw):
    kind = draw(st.sampled_from(("none", "split", "curriculum", "adversarial", "prior")))
    n = 1 if kind in ("none", "prior") else draw(st.integers(2 if kind == "split" else 1, 5))
    ids = draw(st.lists(ids_, min_size=n, max_size=n, unique=True))
    members = {i: draw(st.text(min_size=1, max_size=8) | st.builds(
        EnvMember, env=st.text(min_size=1, max_size=8), kwargs=st.dictionaries(st.text(max_size=4), json_values,
                                                                               max_size=3))) for i in ids}
    if kind == "none":
        structure = None
    elif kind == "split":
        cut = draw(st.integers(1, n - 1))
        structure = Split(train=ids[:cut], test=ids[cut:])
    elif kind == "curriculum":
        edges = draw(st.lists(st.sampled_from([(a, b) for k, a in enumerate(ids) for b in ids[k + 1:]] or [None]),
                              unique=True, max_size=4).map(lambda es: [e for e in es if e is not None]))
        structure = Curriculum(stages=ids, edges=edges, metric=draw(ids_), threshold=draw(finite),
                               require=draw(st.sampled_from(REQUIRES)))
    elif kind == "adversarial":
        structure = AdversarialSet(ids=ids, temperature=draw(st.floats(1e-3, 1e3)), metric=draw(ids_))
    else:
        structure = PriorDistribution(id=ids[0], params=draw(st.dictionaries(ids_, distributions(), min_size=1,
                                                                             max_size=3)))
    return EnvCollection(members=members, structure=structure)


@given(collection=collections())
def test_json_round_trip_is_lossless(collection):
    text = to_json(collection)
    back = from_json(text)
    assert back == collection
    assert to_json(back) == text  # types too: 1 stays 1, 1.0 stays 1.0, true stays true
    assert EnvCollection.from_json(collection.to_json()) == collection


def test_a_hand_written_config_document_parses():
    doc = {"format": "shoal.envcollection/1",
           "members": {"easy": {"env": "Maze-v0", "kwargs": {"size": 5}}, "hard": "Maze-v1"},
           "structure": {"kind": "curriculum", "stages": ["easy", "hard"], "edges": [["easy", "hard"]],
                         "metric": "mean_return", "threshold": 1}}
    collection = from_json(json.dumps(doc))
    assert collection.structure == Curriculum(stages=("easy", "hard"), edges=(("easy", "hard"),),
                                              metric="mean_return", threshold=1.0)
    assert collection.member("easy") == EnvMember(env="Maze-v0", kwargs={"size": 5})


@pytest.mark.parametrize("structure, where, needle", [
    ({"kind": "split", "trian": ["a"], "test": ["b"]}, "structure.trian", "did you mean 'train'?"),
    ({"kind": "curriculm"}, "structure.kind", "did you mean 'curriculum'?"),
    ({"kind": "split", "train": ["a"]}, "structure", "needs the field 'test'"),
    ({"kind": "prior", "id": "a", "params": {"g": {"kind": "unifrom", "low": 0, "high": 1}}},
     "structure.params.g.kind", "did you mean 'uniform'?"),
    ({"kind": "prior", "id": "a", "params": {"g": {"kind": "normal", "mean": 0, "sdt": 1}}},
     "structure.params.g.sdt", "did you mean 'std'?"),
])
def test_json_errors_name_the_field_and_suggest_the_nearest(structure, where, needle):
    doc = {"format": "shoal.envcollection/1", "members": {"a": "A", "b": "B"}, "structure": structure}
    with pytest.raises(CollectionError) as err:
        from_json(json.dumps(doc))
    assert err.value.where == where and needle in str(err.value), str(err.value)


def test_json_of_another_format_is_refused():
    with pytest.raises(CollectionError, match="format"):
        from_json(json.dumps({"format": "shoal.tree/1", "members": {"a": "A"}, "structure": None}))
    with pytest.raises(CollectionError, match="not JSON"):
        from_json("{'format': 'pickle?'}")
