"""`fuel` as a real process, for what only a process shows: Ctrl-C (SIGINT) and a reader that closes the pipe
early (`fuel generate ... | head -c 100`). Either ends the command quietly: status 130 or 141 (128 plus the
signal's number, as a shell reports a process the signal ended), no traceback, no warning at exit.

The generation runs the tiny random Llama of `fuel.testing.llama_files` (one layer, a context of 32768): it
streams ASCII letters for thousands of tokens, long enough to be interrupted mid-stream.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuel.testing.llama_files import tiny_llama_gguf

ROOT = Path(__file__).resolve().parents[1]
LONG = ["--context", "32768", "--max-tokens", "30000"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context=32768, letters_only=True)


def interruptible() -> None:
    """Ctrl-C's default action in the child: a shell running the suite in the background (job control off)
    starts it with SIGINT ignored, which a child would inherit and Python would keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def fuel(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "fuel", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)


def read_some(p: subprocess.Popen[bytes], n: int) -> bytes:
    assert p.stdout is not None
    got = b""
    while len(got) < n:
        chunk = p.stdout.read1(n - len(got))  # type: ignore[attr-defined]
        assert chunk, f"stdout ended after {got!r}; stderr: {p.stderr.read().decode() if p.stderr else ''}"
        got += chunk
    return got


def assert_quiet(err: bytes) -> None:
    text = err.decode()
    for word in ("Traceback", "Exception ignored", "BrokenPipeError", "KeyboardInterrupt", "error"):
        assert word not in text, text


def test_ctrl_c_mid_stream(tiny: Path) -> None:
    p = fuel("generate", "ab", "--model", str(tiny), *LONG)
    try:
        assert read_some(p, 40)[:2] == b"ab"  # streaming
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130
    assert_quiet(err)


@pytest.mark.parametrize("command", ["generate", "embed"])
def test_a_closed_pipe_ends_quietly(tiny: Path, command: str) -> None:
    """`generate`: the reader takes 100 bytes of the stream and closes; `embed`: the reader is gone before
    the first line."""
    args = ["generate", "ab", "--model", str(tiny), *LONG] if command == "generate" else ["embed", "a", "b"]
    p = fuel(*args)
    assert p.stdout is not None and p.stderr is not None
    try:
        if command == "generate":
            read_some(p, 100)
        p.stdout.close()
        start = time.monotonic()
        p.wait(timeout=180)
        err = p.stderr.read()
    finally:
        p.kill()
    assert p.returncode == 141, err.decode()
    assert_quiet(err)
    assert time.monotonic() - start < 60  # it stopped at the closed pipe, not at the end of 30000 tokens
