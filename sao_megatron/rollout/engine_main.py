"""``python -m sao_megatron.rollout.engine_main SGLANG_ARGS...``: ``sglang.launch_server`` taking its
API key as one line on stdin instead of ``--api-key KEY`` on the command line.

On the command line the key is in ``ps`` and ``/proc/PID/cmdline`` for every user of the node; and
SGLang logs its resolved arguments when it starts, key included, into the engine's log. Here the
key reaches SGLang's argument parser inside this process only, and every log record this process
makes has the key replaced by :data:`REDACTED` (SGLang's scheduler processes do not log it).
:class:`~sao_megatron.rollout.engine.EngineProcess` starts engines this way when they have a key.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

REDACTED = "<api key>"


def read_key() -> str:
    """The key on stdin's first line; stdin is then ``/dev/null`` (as for an engine without one)."""
    key = sys.stdin.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return key


def redact_logs(secret: str) -> None:
    """Every log record made in this process from now on shows ``secret`` as :data:`REDACTED`.

    A record factory, not a handler's filter: SGLang replaces the root logger's handlers
    (``logging.basicConfig(force=True)``) while it parses its arguments."""
    make_record = logging.getLogRecordFactory()

    def record(*args, **kwargs) -> logging.LogRecord:
        made = make_record(*args, **kwargs)
        try:
            text = made.getMessage()
        except Exception:  # a bad format: the handler reports it, as it would have
            return made
        if secret in text:
            made.msg, made.args = text.replace(secret, REDACTED), None
        return made

    logging.setLogRecordFactory(record)


def main(argv: list[str]) -> None:
    key = read_key()
    if not key:
        sys.exit("engine_main: no API key on stdin (EngineProcess sends EngineSpec.api_key there)")
    redact_logs(key)
    sys.argv = [sys.argv[0], *argv, "--api-key", key]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
