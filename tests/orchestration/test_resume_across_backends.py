"""One training loop for every backend, from the command line: a checkpoint is backend-free."""

from __future__ import annotations


def test_a_run_resumed_on_the_other_backend_goes_on_as_the_uninterrupted_one(tmp_path, ray_session):
    """A checkpoint is backend-free: a local run resumed on Ray, and a Ray run resumed locally, write the rows an
    uninterrupted local run writes (synchronous mode: exact on both backends)."""
    import csv

    from orchestration.cli import main

    def rows(path) -> list[dict]:
        with open(path / "metrics.csv") as f:  # what is learned and counted, not timed
            return [{k: v for k, v in row.items() if not k.startswith("time_") and not k.endswith("_per_s")
                     and k != "weights_serializations"} for row in csv.DictReader(f)]

    flags = ["builtin:cartpole", "--rollout.num-envs", "4", "--rollout.fragment-length", "16", "--seed", "4",
             "--no-progress", "--no-anneal-lr"]
    ray = ["--backend", "ray", "--ray.worker-num-cpus", "0", "--ray.learner-num-cpus", "0"]
    main(["train", *flags, "--iterations", "3", "--run-dir", str(tmp_path / "whole")])
    for name, first, then in (("to_ray", [], ray), ("to_local", ray, ["--backend", "local"])):
        main(["train", *flags, *first, "--iterations", "2", "--run-dir", str(tmp_path / name)])
        main(["train", "--resume", "--run-dir", str(tmp_path / name), "--iterations", "3", "--no-progress", *then])
        got = rows(tmp_path / name)
        assert [{k: row.get(k) for k in rows(tmp_path / "whole")[0]} for row in got] == rows(tmp_path / "whole"), name
