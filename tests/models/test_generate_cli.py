"""`fuel generate` in-process (`fuel.cli.main`): each error is one line `fuel: error: ...` on stderr with status 2,
found before the slow steps it would otherwise follow; a full KV cache is told on stderr.

Broken GGUF files and the streaming checks use the tiny random Llama of `fuel.testing.llama_files` (it
greedily emits ASCII letters, never an end-of-turn token); the checks that the prompt is validated before
loading use SmolLM2 (only its header and tokenizer are read). Real processes (Ctrl-C, a closed pipe) are
in tests/test_cli_process.py.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from fuel.cli import main
from fuel.io.gguf import GGUFFile
from fuel.models import generate as gen
from fuel.models.generate_cli import warm_up
from fuel.models.llama import LlamaModel
from fuel.testing.llama_files import tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context=512, letters_only=True)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The error line, checked to be the last line of stderr, the only one that says error, and no traceback."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines and lines[-1].startswith("fuel: error: ") and sum("error" in ln for ln in lines) == 1, err
    return lines[-1]


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the weights load."""
    monkeypatch.setattr(LlamaModel, "__init__", lambda *a, **kw: pytest.fail("loaded the weights before the check"))


@pytest.mark.parametrize("missing", ["llama.block_count", "llama.feed_forward_length", "token_embd.weight"])
def test_a_file_missing_a_key_is_one_line(tiny: Path, tmp_path: Path, missing: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_llama_gguf(tmp_path / "broken.gguf", drop=[missing])
    code, out, err = run(["generate", "hi", "--model", str(path), "--context", "16"], capsys)
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert repr(missing) in line and str(path) in line


def test_a_file_that_is_not_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"not a model, just some text\n")
    code, _, err = run(["generate", "hi", "--model", str(path)], capsys)
    assert code == 2 and "not a GGUF file" in one_error_line(err)


@pytest.mark.parametrize(("argv", "message"), [
    (["--context", "1"], "the prompt has 49 tokens, more than --context 1; give a larger --context"),
    (["--context", "9000"], "--context 9000 is more than the model's context of 8192 tokens"),
    (["", "--context", "256"], "the prompt is empty"),
    (["a\udcffb", "--context", "256"], "the prompt holds a lone surrogate '\\udcff' at index 1"),
    (["word " * 300, "--context", "256"], "the prompt has 301 tokens, more than --context 256"),
    (["hi", "--stop", "", "--context", "256"], "stop must be None, a non-empty str or a list of them"),
], ids=["context-1", "context-past-the-model", "empty", "surrogate", "too-long", "empty-stop"])
def test_the_request_is_checked_before_loading_and_echoing(argv: list[str], message: str, no_loading: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt that cannot run fails before the weights load, the steps are captured or the prompt is
    echoed: stdout stays empty."""
    code, out, err = run(["generate", *argv], capsys)
    assert code == 2 and out == ""
    assert message in one_error_line(err)


def test_a_full_kv_cache_is_told_on_stderr(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache of 8 tokens and a prompt of 2: 7 letters come (the last one sampled, not run), then stderr
    says why the text stopped; the status stays 0."""
    code, out, err = run(["generate", "ab", "--model", str(tiny), "--context", "8", "--max-tokens", "50"], capsys)
    assert code == 0
    assert out.startswith("ab") and out.endswith("\n") and len(out) == 2 + 7 + 1 and out[2:-1].isalpha()
    assert "stopped after 7 tokens: the KV cache is full (--context)" in err
    code, out, err = run(["generate", "ab", "--model", str(tiny), "--context", "64", "--max-tokens", "7"], capsys)
    assert code == 0 and len(out) == 2 + 7 + 1 and "KV cache is full" not in err


def test_stop_sequences(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["generate", "ab", "--model", str(tiny), "--context", "64", "--max-tokens", "30"], capsys)
    text = out[2:-1]
    stop = text[12:15]
    code, out, _ = run(["generate", "ab", "--model", str(tiny), "--context", "64", "--max-tokens", "30",
                        "--stop", "#", "--stop", stop], capsys)
    assert code == 0 and out == "ab" + text[:text.find(stop)] + "\n"


def test_chat_from_stdin(tiny: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n\nnot read\n"))
    code, out, err = run(["generate", "--chat", "--model", str(tiny), "--context", "512", "--max-tokens", "5"],
                         capsys)
    assert code == 0 and [len(line) for line in out.splitlines()] == [5, 5]
    assert "decode: 8 tokens" in err and "Traceback" not in err  # each turn's last token is not run


def test_chat_stdin_that_is_not_utf8(tiny: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8"))
    code, _, err = run(["generate", "--chat", "--model", str(tiny), "--context", "64"], capsys)
    assert code == 2 and "stdin is not utf-8 text" in one_error_line(err)


def test_ctrl_c_is_status_130_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupt anywhere in a command (here while the file is read): status 130 and nothing printed
    (the real signal: tests/test_cli_process.py)."""
    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    path = tiny_llama_gguf(tmp_path / "t.gguf")
    monkeypatch.setattr(GGUFFile, "__init__", interrupted)
    code, out, err = run(["generate", "ab", "--model", str(path)], capsys)
    assert (code, out, err) == (130, "", "")


def test_warm_up_captures_every_step_a_timed_run_uses(smollm2: gen.LLM) -> None:
    """The reported speeds are those of replayed steps: the warm-up captures, on the sequence the run
    uses, the prompt's prefill chunk (which gives the logits itself) and the decode step, and leaves the
    cache empty."""
    seq = smollm2.model.sequence()
    warm_up(seq, 37, io.StringIO())
    assert seq.pos == 0
    assert seq.prefill_last_step.captures == 1 and seq.decode_step.captures == 1
    seq.prefill(list(range(100, 137)))
    seq.decode(5)
    assert seq.prefill_last_step.captures == 1 and seq.decode_step.captures == 1  # nothing captured anew


def test_demo_streams_an_answer(capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo`: SmolLM2 answers the default question greedily; the speeds and peak RSS follow."""
    code, out, err = run(["demo", "--max-tokens", "12", "--context", "256"], capsys)
    assert code == 0
    assert out.startswith("> What is the capital of France") and "Paris" in out
    assert "tokens/s" in err and "peak RSS" in err


def test_the_sampling_flags_reach_the_sampler(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--min-p, --presence-penalty, --frequency-penalty and --repetition-penalty give the text `LLM.generate`
    gives with the same arguments (tests/models/test_generate_sampling.py holds that to transformers), and
    another text than without them."""
    flags = {"min_p": 0.05, "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.4}
    argv = ["generate", "ab", "--model", str(tiny), "--context", "64", "--max-tokens", "30", "--temperature", "0.7",
            "--seed", "3"]
    code, plain, _ = run(argv, capsys)
    code, out, _ = run([*argv, *(x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v)))], capsys)
    want = gen.load(str(tiny), 64).generate("ab", 30, temperature=0.7, seed=3, **flags)
    assert code == 0 and out == "ab" + "".join(want) + "\n" != plain


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--min-p", "1.5", "argument --min-p: expected a number in [0, 1], got 1.5"),
    ("--presence-penalty", "-3", "argument --presence-penalty: expected a number in [-2, 2], got -3"),
    ("--frequency-penalty", "nan", "argument --frequency-penalty: expected a number in [-2, 2], got nan"),
    ("--repetition-penalty", "0", "argument --repetition-penalty: expected a finite number > 0, got 0"),
])
def test_sampling_flags_out_of_range_are_one_line(flag: str, value: str, message: str, no_loading: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", flag, value])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2
    assert err.splitlines() == [f"fuel generate: error: {message} (see: fuel generate --help)"]
