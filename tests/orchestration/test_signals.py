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


HELD = """
import os, signal, subprocess, sys
from orchestration.signals import held_interrupts
with held_interrupts():
    os.kill(os.getpid(), signal.SIGINT)  # held: no KeyboardInterrupt here
    child = subprocess.run(["grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True).stdout
    print("child blocks SIGINT", bool(int(child.split()[1], 16) & (1 << (signal.SIGINT - 1))))
    print("still here")
"""


def test_a_held_interrupt_comes_after_the_block_and_children_started_in_it_block_it():
    """:func:`held_interrupts` (around ``ray.init``): Ctrl-C in the block is delivered when it ends, not lost; the
    processes started inside (Ray's raylet and agents) inherit the block, so the terminal's Ctrl-C, which reaches
    the whole process group, no longer kills them mid-start (leaving orphaned agents for a minute)."""
    out = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, timeout=60)
    assert "child blocks SIGINT True" in out.stdout and "still here" in out.stdout, out
    assert out.returncode != 0 and "KeyboardInterrupt" in out.stderr, out  # delivered once the block ended


def test_ctrl_c_while_a_local_ray_instance_starts_leaves_none_of_its_processes(tmp_path):
    """A terminal's Ctrl-C (the whole process group) while ``ray.init`` starts a local instance: the run ends in
    one line (exit 130) and Ray's processes go with it; the driver died mid-start before, its raylet with it
    (fate-shared), and the raylet's agents lived on for a minute."""
    import os
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "train", "builtin:cartpole", "--backend",
                                "ray", "--ray.num-cpus", "2", "--iterations", "100000", "--no-progress", "--run-dir",
                                str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # its own group, as a terminal's foreground job

    def group() -> list[str]:  # our group's processes but the driver (orphans keep their group)
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
        return [line for line in ps.splitlines() if line.split()[1] == str(process.pid)
                and line.split()[0] != str(process.pid) and "<defunct>" not in line]

    try:
        deadline = time.monotonic() + 60
        while not any("raylet" in line for line in group()):  # Ray is starting
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130 and "shoal train: interrupted" in err and "Traceback" not in err, err[-2000:]
    deadline = time.monotonic() + 5
    while group() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group()
    for line in left:  # not to outlive the test
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert left == []
