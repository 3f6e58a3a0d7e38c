"""``sao swe import``: SWE-bench records into this project's task file (:mod:`sao_megatron.cli`).

Exit status: 0 when every record was imported, 1 when some were skipped (the task file holds
the others; the skipped ones, with reasons, are in ``<out>.skipped.jsonl``), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """examples:
  sao swe import swe_bench_verified.parquet --repos /data/mirrors --out /data/swe_tasks.jsonl
  sao swe import records.jsonl --repos mirrors --verify --env-kwargs '{"test_timeout_s": 300}' --out tasks.jsonl
mirror of repo owner/name: MIRROR_DIR/owner__name[.git], else MIRROR_DIR/owner/name[.git]
see docs/envs.md ("Importing SWE-bench records")
"""


def cmd_swe_import(args) -> int:
    from sao_megatron.envs.swe.importer import import_records

    if args.from_image:
        print(
            "swe import error: --from-image is not supported yet (no container runtime runs here to test "
            "it); clone the repositories into a directory and pass --repos DIR",
            file=sys.stderr,
        )
        return 2
    if not args.repos:
        print("swe import error: --repos MIRROR_DIR is required (the directory of git mirrors)", file=sys.stderr)
        return 2
    try:
        env_kwargs = json.loads(args.env_kwargs)
    except json.JSONDecodeError as err:
        print(
            f"swe import error: --env-kwargs is not JSON ({err}); e.g. '{{\"test_timeout_s\": 300}}'", file=sys.stderr
        )
        return 2
    if not isinstance(env_kwargs, dict):
        print("swe import error: --env-kwargs must be a JSON object of SWEEnv keyword arguments", file=sys.stderr)
        return 2
    report = import_records(args.records, args.repos, args.out, verify=args.verify, env_kwargs=env_kwargs)
    print(report.summary())
    return 1 if report.skipped else 0


def add_swe_parser(sub) -> None:
    text = "software-engineering tasks: import SWE-bench records"
    p = sub.add_parser("swe", help=text, description=text)
    swe = p.add_subparsers(dest="swe_command", metavar="SWE_COMMAND", required=True)
    text = "SWE-bench records (JSONL/Parquet) + git mirrors -> a task file of the swe environment"
    p = swe.add_parser(
        "import", help=text, description=text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("records", metavar="RECORDS", help="SWE-bench records, .jsonl or .parquet")
    p.add_argument("--repos", metavar="MIRROR_DIR", help="directory of the repositories' git mirrors")
    p.add_argument(
        "--from-image",
        metavar="IMAGE",
        help="read each repository from the task's container image (not supported yet)",
    )
    p.add_argument("--out", required=True, metavar="TASKS_FILE", help="the task file to write (.jsonl)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="run each task's tests in the swe sandbox: FAIL_TO_PASS must fail before the gold patch, "
        "every test pass after it",
    )
    p.add_argument(
        "--env-kwargs",
        default="{}",
        metavar="JSON",
        help="SWEEnv keyword arguments for --verify (test_timeout_s, memory_mb, container, ...)",
    )
    p.set_defaults(fn=cmd_swe_import)
