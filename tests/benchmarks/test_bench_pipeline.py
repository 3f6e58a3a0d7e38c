"""``bench_pipeline --pin``: engine processes (and every thread in them) on their own cores."""

import os
import subprocess
import sys
import time

import pytest

from benchmarks.bench_pipeline import CorePinner, _cores

# An "engine": its command line names SGLang's server module, it starts a thread and a child
# process (as the server starts its scheduler), all of which must end up on the engine cores.
ENGINE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _affinities(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to give the roles disjoint ones")
def test_pinner_moves_every_engine_thread_and_child_and_leaves_the_rest():
    before = os.sched_getaffinity(0)
    engine_core, rest_core = sorted(before)[:2]
    procs = []
    try:
        with CorePinner({engine_core}, {rest_core}, period_s=0.1) as pinner:
            other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            engine = subprocess.Popen(
                [sys.executable, "-c", ENGINE, "-m", CorePinner.ENGINE_MARK], stdout=subprocess.PIPE, text=True
            )
            procs = [other, engine]
            assert engine.stdout is not None
            child = int(engine.stdout.readline())
            deadline = time.monotonic() + 10
            want = {engine.pid: {engine_core}, child: {engine_core}, other.pid: {rest_core}}
            while time.monotonic() < deadline:
                got = {pid: set().union(*_affinities(pid).values()) for pid in want}
                threads = set(_affinities(engine.pid))  # a new thread inherits its core before a scan sees it
                if got == want and len(threads) >= 2 and threads <= pinner.engine_threads:
                    break
                time.sleep(0.1)
            assert got == want
            assert all(cores == {engine_core} for cores in _affinities(engine.pid).values())
            assert set(_affinities(engine.pid)) <= pinner.engine_threads
            assert os.sched_getaffinity(0) == {rest_core}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for tid in os.listdir("/proc/self/task"):  # the pinner moved every thread of this process
            os.sched_setaffinity(int(tid), before)


@pytest.mark.parametrize(
    "spec, message",
    [("0", "ENGINE:REST"), ("0:0", "disjoint"), ("0:x", "ENGINE:REST"), ("0:4096", "within")],
)
def test_pin_spec_errors_name_the_flag_and_the_fix(spec, message):
    with pytest.raises(ValueError, match="--pin") as e:
        CorePinner.parse(spec)
    assert message in str(e.value)


def test_pin_spec_parses_lists_and_ranges():
    assert _cores("0") == {0}
    assert _cores("0,2-4,7") == {0, 2, 3, 4, 7}
    cores = sorted(os.sched_getaffinity(0))
    pinner = CorePinner.parse(f"{cores[0]}:{cores[-1]}") if len(cores) > 1 else None
    assert pinner is None or (pinner.engine, pinner.rest) == ({cores[0]}, {cores[-1]})
