"""What the leader of a server's session (``rollout.server_session``) costs while the server runs:
its CPU seconds and resident memory over ``--seconds`` of an idle server (``sleep``).

    .venv/bin/python benchmarks/bench_server_session.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time

from sao_megatron.rollout.server_session import die_with_parent, led


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # state ppid ... utime(11) stime(12)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kb(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    leader = subprocess.Popen(
        led(["sleep", str(args.seconds + 5)]), start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM)
    )
    time.sleep(1.0)  # past the leader's start-up
    cpu0, t0 = _cpu_s(leader.pid), time.monotonic()
    time.sleep(args.seconds)
    cpu1, t1 = _cpu_s(leader.pid), time.monotonic()
    print(
        f"leader: {cpu1 - cpu0:.2f} CPU-s in {t1 - t0:.1f} s ({100 * (cpu1 - cpu0) / (t1 - t0):.3f}% of a core), "
        f"RSS {_rss_kb(leader.pid) / 1024:.1f} MiB"
    )
    leader.terminate()
    leader.wait()


if __name__ == "__main__":
    main()
