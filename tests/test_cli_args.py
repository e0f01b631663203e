"""The `fuel` command checks its arguments before doing any work and names what is valid."""

from __future__ import annotations

import pytest

from fuel.cli import main


def test_verify_refuses_an_unknown_name_among_good_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "SoftmaxLastDim", "NoSuchOp"]) == 2
    err = capsys.readouterr().err
    assert "no entry named NoSuchOp" in err and "RmsNormLastDim" in err


def test_verify_accepts_the_builder_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "softmax_last_dim_backward"]) == 0
    out = capsys.readouterr().out
    assert "SoftmaxLastDimBackward[cpu:f32,f32,f32]" in out and "4 passed, 0 failed" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--dtype", "f99"], "unknown dtype f99; valid: f32, f64, bf16, f16"),
    (["bench", "--dtype", "f32,bogus"], "unknown dtype bogus"),
    (["bench", "--repeat", "0"], "expected a positive integer, got 0"),
    (["bench", "--repeat", "x"], "expected a positive integer, got 'x'"),
])
def test_bench_arguments_are_checked_before_measuring(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.bench_ops as bench_ops

    def must_not_run(*args: object) -> int:
        raise AssertionError("bench started measuring with bad arguments")

    monkeypatch.setattr(bench_ops, "main", must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_an_unknown_case_before_measuring(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.bench_ops as bench_ops

    monkeypatch.setattr(bench_ops, "machine_limits", lambda: pytest.fail("measured before checking names"))
    assert main(["bench", "no_such_case"]) == 2
    assert "unknown case(s) ['no_such_case']" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["generate", "hi", "--seed", "x"], "argument --seed: expected an integer >= 0, got 'x'"),
    (["generate", "hi", "--context", "0"], "argument --context: expected an integer >= 1, got 0"),
    (["generate", "hi", "--max-tokens", "-3"], "argument --max-tokens: expected an integer >= 0, got -3"),
    (["generate", "hi", "--top-p", "0"], "argument --top-p: expected a number in (0, 1], got 0"),
    (["generate", "hi", "--top-p", "1.5"], "argument --top-p: expected a number in (0, 1], got 1.5"),
    (["generate", "hi", "--temperature", "nan"], "argument --temperature: expected a finite number >= 0, got nan"),
    (["generate", "hi", "--top-k", "-1"], "argument --top-k: expected an integer >= 0, got -1"),
    (["demo", "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["embed", "a", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
])
def test_model_arguments_are_checked_before_loading(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by argparse in one line (`fuel <command>: error: ...`, status 2) before any file is read."""
    from fuel.io.gguf import GGUFFile
    from fuel.models import bert

    monkeypatch.setattr(GGUFFile, "__init__", lambda *a: pytest.fail("read a model with bad arguments"))
    monkeypatch.setattr(bert, "embed", lambda *a, **kw: pytest.fail("embedded with bad arguments"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert err.startswith(f"fuel {argv[0]}: error: ") and err.endswith(f"(see: fuel {argv[0]} --help)\n")
