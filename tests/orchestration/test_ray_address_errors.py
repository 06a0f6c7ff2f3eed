"""A Ray cluster address where nothing listens is a user's mistake: one paragraph naming the flag, at once (Ray
itself retries such an address for minutes)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from orchestration.addresses import check_reachable


def _closed_port() -> int:
    with socket.socket() as s:  # a port the OS just handed out and nobody listens on once it is closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_nothing_listens_is_named_with_its_flag():
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ValueError, match=rf"cannot reach a Ray cluster at --address '{address}' \(Connection refused"):
        check_reachable(address, "--address")
    check_reachable("auto", "RAY_ADDRESS")  # Ray finds these itself
    check_reachable("ray://head:10001", "--address")


def test_shoal_train_tells_an_unreachable_cluster_in_one_paragraph(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    out = subprocess.run([sys.executable, "-m", "orchestration.cli", "train", "builtin:cartpole", "--backend", "ray",
                          "--address", address, "--iterations", "1", "--no-progress"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"shoal train: cannot reach a Ray cluster at --address '{address}'" in out.stderr
