"""Shared test configuration: hypothesis profiles, the session-scoped Ray instance, markers."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# One thread per test process: the machine has 2 cores and CI runs other things beside us.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test starts with one torch thread, whatever the test before it set (an in-process ``shoal``
    command sets the process's count): a seeded learning test's result depends on it (connect four self-play,
    seed 0, 50 iterations: 0.94/0.95 wins against random with 1 thread, 0.87/0.88 with 2)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (``num_cpus=2``), shut down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def pool_factory():
    """Builds :class:`adapters.env_worker.EnvWorkerPool` s (``factories``, ``**EnvWorkerConfig``) closed after the test."""
    from adapters.env_worker import EnvWorkerConfig, EnvWorkerPool

    pools = []

    def make(factories, **config):
        pool = EnvWorkerPool(factories, EnvWorkerConfig(**config))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


# Modules whose tests start Ray clusters of their own (a test cluster, an unreachable address), which must not
# overlap the session instance nor another test's.
_OWN_RAY = ("test_ray_cluster.py", "test_ray_address_errors.py")


def pytest_collection_modifyitems(config, items):
    """Every test that touches Ray joins one ``xdist_group``: under ``pytest -n 2 --dist loadgroup`` (the README's
    command) they all run in one worker process, one after another, beside the session's single Ray instance,
    while the other worker runs tests without Ray. Tests that need CUDA are skipped without it."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or item.path.name in _OWN_RAY or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
