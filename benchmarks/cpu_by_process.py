"""CPU seconds of a command and everything it starts, grouped by kind of process.

    .venv/bin/python benchmarks/cpu_by_process.py [--json OUT] -- CMD [ARG ...]

Runs CMD with a marker in its environment (inherited by Ray's daemons and workers, SGLang's
processes and Megatron's ranks, whatever re-parents them), samples every marked process's CPU
times every ``--every`` seconds while CMD runs, and prints CPU seconds per kind (the script or
module a Python process runs, else the executable's name) with the first and last time each kind
was seen. A process that lives less than one interval may be missed: totals are lower bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

MARK = "CPU_BY_PROCESS_TOKEN"  # not SAO_-prefixed: tests that launch `sao train` drop those


def kind(cmdline: list[str]) -> str:
    """`-m module`, or the script a Python process runs, or the executable's name."""
    if not cmdline:
        return "?"
    args = cmdline[1:] if "python" in Path(cmdline[0]).name else cmdline
    if "python" in Path(cmdline[0]).name:
        for i, arg in enumerate(args):
            if arg == "-m" and i + 1 < len(args):
                return args[i + 1]
            if arg == "-c" and i + 1 < len(args):
                return "-c " + (args[i + 1].strip().splitlines() or [""])[0].split(";")[0][:40]
            if not arg.startswith("-"):
                return Path(arg).name
    return Path(args[0]).name


def marked(token: str) -> dict[int, tuple[float, str]]:
    """pid -> (CPU seconds so far, kind) for every live process carrying the marker."""
    tick = os.sysconf("SC_CLK_TCK")
    mark = f"{MARK}={token}".encode()
    found: dict[int, tuple[float, str, int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            stat = (proc / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # state ppid ... utime(11) stime(12)
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            name = kind([a for a in cmdline if a])
            found[int(proc.name)] = ((int(fields[11]) + int(fields[12])) / tick, name, int(fields[1]))
        except (OSError, ValueError, IndexError):
            continue
    # A multiprocessing child says only that it was spawned: name it by its parent (an SGLang
    # server's scheduler and detokenizer, a Ray actor's Megatron rank).
    return {
        pid: (
            cpu,
            f"{name} < {found[ppid][1]}" if name.startswith("-c from multiprocessing") and ppid in found else name,
        )
        for pid, (cpu, name, ppid) in found.items()
    }


def profile(cmd: list[str], every_s: float = 0.5) -> dict:
    token = uuid.uuid4().hex
    env = {**os.environ, MARK: token}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)
    seen: dict[int, dict] = {}
    while True:
        done = proc.poll() is not None
        now = time.monotonic() - t0
        for pid, (cpu, name) in marked(token).items():
            entry = seen.setdefault(pid, {"kind": name, "first_s": now})
            entry.update(cpu_s=cpu, last_s=now, kind=name)  # a spawned child's kind settles after exec
        if done:
            break
        time.sleep(every_s)
    wall = time.monotonic() - t0
    kinds: dict[str, dict] = defaultdict(lambda: {"cpu_s": 0.0, "processes": 0, "first_s": 1e18, "last_s": 0.0})
    for entry in seen.values():
        k = kinds[entry["kind"]]
        k["cpu_s"] += entry["cpu_s"]
        k["processes"] += 1
        k["first_s"] = min(k["first_s"], entry["first_s"])
        k["last_s"] = max(k["last_s"], entry["last_s"])
    return {
        "command": cmd,
        "returncode": proc.returncode,
        "wall_s": wall,
        "cpu_s": sum(k["cpu_s"] for k in kinds.values()),
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=0.5, help="sampling interval, seconds")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG ...]")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command: give it after --")
    result = profile(cmd, args.every)
    print(f"wall {result['wall_s']:.1f} s, CPU {result['cpu_s']:.1f} s, exit {result['returncode']}")
    for name, k in result["kinds"].items():
        print(f"{k['cpu_s']:8.1f} CPU-s {k['processes']:3d} proc  {k['first_s']:6.1f}-{k['last_s']:6.1f} s  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
