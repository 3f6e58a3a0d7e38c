"""Stand-in for ``sao train`` in launch tests: records that it started, then waits for SIGINT.

Usage: ``python stub_driver.py MARKER [ignored args...]``. Writes ``started`` to MARKER, then
``SIGINT`` and exits 0 when a KeyboardInterrupt arrives (``timeout``, exit 3, after 300 s).
"""

import sys
import time
from pathlib import Path

marker = Path(sys.argv[1])
marker.write_text("started\n")
try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        time.sleep(0.05)
    marker.write_text("timeout\n")
    sys.exit(3)
except KeyboardInterrupt:
    marker.write_text("SIGINT\n")
    sys.exit(0)
