"""benchmarks/cpu_by_process.py counts the CPU of processes that left the command's tree."""

from __future__ import annotations

import sys

from benchmarks.cpu_by_process import kind, profile

SPIN_S = 1.0
DAEMON = f"""
import os, sys, time
done = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # re-parented to init: outside the command's process tree
        start = time.process_time()
        while time.process_time() - start < {SPIN_S}:
            pass
        time.sleep(1.5)  # sampled at least once after spinning
        open(done, "w").close()
    os._exit(0)
while not os.path.exists(done):
    time.sleep(0.05)
"""


def test_a_double_forked_daemons_cpu_is_counted_under_its_kind(tmp_path):
    result = profile([sys.executable, "-c", DAEMON, str(tmp_path / "done")], every_s=0.2)
    assert result["returncode"] == 0
    spinner = result["kinds"]["-c import os, sys, time"]  # the command and its forks run the same code
    assert spinner["processes"] >= 2, result  # the middle fork lives less than an interval
    assert spinner["cpu_s"] >= SPIN_S - 0.05, result  # clock ticks: 1/100 s each, per process
    assert result["cpu_s"] >= spinner["cpu_s"]


def test_kind_names_the_module_or_script_a_python_process_runs():
    assert kind(["/v/bin/python", "-u", "-m", "sglang.launch_server", "--port", "1"]) == "sglang.launch_server"
    assert kind(["/v/bin/python", "-u", "/ray/_private/log_monitor.py", "--x"]) == "log_monitor.py"
    assert kind(["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]).startswith(
        "-c from multiprocessing.spawn"
    )
    assert kind(["/ray/core/src/ray/raylet/raylet", "--flag"]) == "raylet"
