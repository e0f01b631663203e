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
