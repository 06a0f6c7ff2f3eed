"""The result line every command prints last is strict JSON: a metric not yet defined (no episode ended) is
``null``, never ``NaN``, which RFC 8259 parsers (jq, JavaScript, Go) refuse."""

from __future__ import annotations

import json
import math

import pytest

from orchestration.result_line import result_json, strict


def _strict_loads(text: str):
    """``json.loads`` that refuses ``NaN``/``Infinity``, as RFC 8259 parsers do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth():
    value = {"a": math.nan, "b": [1.5, -math.inf, {"c": math.inf}], "d": (2, "NaN"), "e": 0.0, "f": True}
    assert strict(value) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "NaN"], "e": 0.0, "f": True}
    assert _strict_loads(result_json(value))["b"] == [1.5, None, {"c": None}]
    with pytest.raises(ValueError):
        _strict_loads(json.dumps(value))  # what the commands printed before


def test_a_run_in_which_no_episode_ended_prints_null_not_nan(tmp_path, capsys):
    """Four CartPole steps with 2 envs: no episode can end (a random policy's last >= 8 steps), so the mean
    return is undefined; the printed result parses strictly and says so with null."""
    from orchestration.cli import main

    main(["train", "builtin:cartpole", "--iterations", "1", "--rollout.num-envs", "2", "--rollout.fragment-length",
          "4", "--no-progress", "--run-dir", str(tmp_path / "run")])
    result = _strict_loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["episode_return_mean"] is None and result["env_steps"] == 8


def test_an_asynchronous_run_records_its_settled_accounting_in_run_json_and_its_result(tmp_path, capsys):
    """The tally :meth:`Trainer.close` settles (fragments in flight at the last row are accepted or lost by then)
    was computed and never written: metrics.csv and run.json stopped at the last iteration's row."""
    from orchestration.cli import main

    main(["train", "builtin:cartpole", "--iterations", "3", "--rollout.num-envs", "4", "--rollout.fragment-length",
          "16", "--rollout.num-workers", "2", "--mode", "async", "--train-batch-size", "64", "--max-staleness", "0",
          "--no-progress", "--run-dir", str(tmp_path / "run")])
    result = _strict_loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = json.loads((tmp_path / "run" / "run.json").read_text())["final_accounting"]
    assert result["accounting"] == final and "argv" in json.loads((tmp_path / "run" / "run.json").read_text())
    assert final["fragments_in_flight"] == 0 and final["fragments_produced"] >= 4
    assert final["fragments_produced"] == final["fragments_accepted"] + final["fragments_stale"] + \
        final["fragments_lost"]
