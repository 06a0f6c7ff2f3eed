"""SIGTERM in the ``shoal`` process (:mod:`orchestration.signals`): unwinds like Ctrl-C where nothing else
handles it, while forked children (gymnasium's AsyncVectorEnv workers, a user's forking factory) still die of
it, and ``ray.init`` does not take the handler over."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import multiprocessing, os, signal, sys, time
from orchestration.signals import Terminated, kept_sigterm, stop_on_sigterm
stop_on_sigterm()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
time.sleep(1)  # running (a signal before its after-fork hook ran would race with it)
child.terminate()
child.join(10)
print("child", child.exitcode)
with kept_sigterm():
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))  # what ray.init does
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except Terminated:
    print("terminated")
print("second", signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
"""


def test_sigterm_unwinds_the_shoal_process_but_not_its_forked_children():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:3] == ["child -15", "terminated", "second True"], out.stdout + out.stderr


RAY_SCRIPT = """
import signal
from orchestration.config import RayConfig, TrainConfig
from orchestration.ray_session import init_ray
from orchestration.signals import stop_on_sigterm
stop_on_sigterm()
mine = signal.getsignal(signal.SIGTERM)
init_ray(TrainConfig(backend="ray"), RayConfig(num_cpus=1))
print("kept", signal.getsignal(signal.SIGTERM) is mine)
"""


def test_ray_init_does_not_take_the_sigterm_handler_over():
    out = subprocess.run([sys.executable, "-c", RAY_SCRIPT], capture_output=True, text=True, timeout=120)
    assert "kept True" in out.stdout, out.stdout + out.stderr[-2000:]



DEFERRED_SCRIPT = """
import os, signal, time
from orchestration.signals import deferred_interrupts, stop_on_sigterm
stop_on_sigterm()
before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
with deferred_interrupts():
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C during a clean-up: nothing raised
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
print("restored", (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print("interrupted after")
"""


def test_interrupts_in_a_deferred_block_are_ignored_and_the_handlers_come_back():
    out = subprocess.run([sys.executable, "-c", DEFERRED_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["restored True", "interrupted after"], out.stdout + out.stderr
