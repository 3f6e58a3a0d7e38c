"""Run a selection of tests several times in a row with CPU burners beside them.

``python tools/under_load.py [--burners 2] [--passes 3] [--nice 0] -- PYTEST_ARGS...``

A test with a wall-clock bound that passes on an idle machine may fail in CI, where the suite's
other worker shares the two cores. Before a submission that touches such a test, run it here: each
pass is one ``pytest`` process with ``--burners`` busy-looping processes at ``--nice`` beside it
(default two, as many as this machine has cores), and every pass must succeed. The burners are this
tool's own children, ended by PID when it exits. Exit status: 0 when every pass passed, else the
first failing pass's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BURN = "import os, sys\nos.nice(int(sys.argv[1]))\nwhile True:\n    pass\n"


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        ours, pytest_args = argv[:split], argv[split + 1 :]
    else:
        ours, pytest_args = argv, []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burners", type=int, default=2, help="busy-looping processes beside the tests")
    parser.add_argument("--passes", type=int, default=3, help="pytest runs in a row; each must pass")
    parser.add_argument("--nice", type=int, default=0, help="the burners' niceness (0: as the tests)")
    args = parser.parse_args(ours)
    if not pytest_args:
        parser.error("name the tests after --, e.g. -- -q tests/driver/test_engine_restart.py")
    if args.burners < 0 or args.passes < 1:
        parser.error("--burners must be >= 0 and --passes >= 1")
    burners = [subprocess.Popen([sys.executable, "-c", BURN, str(args.nice)]) for _ in range(args.burners)]
    rc = 0
    try:
        for n in range(1, args.passes + 1):
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args])
            seconds = time.monotonic() - t0
            print(
                f"under_load: pass {n}/{args.passes} with {args.burners} burner(s): exit {done.returncode} in {seconds:.0f} s"
            )
            if done.returncode != 0:
                rc = done.returncode
                break
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    print(f"under_load: {'every pass passed' if rc == 0 else f'failed (exit {rc})'}", flush=True)
    return rc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    sys.exit(main(sys.argv[1:]))
