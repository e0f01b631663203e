"""`fuel serve`'s command line: its options, and a clear message when the serve extra is missing. (The running
server is tested in test_server.py.)"""

from __future__ import annotations

import sys

import pytest

from fuel.cli import main


@pytest.mark.parametrize("module", ["starlette", "uvicorn", "prometheus_client"])
def test_missing_extra_says_how_to_install(module: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed: find_spec gives None
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fuel: error:") and module in err and "pip install 'fuel[serve]'" in err


def test_unknown_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fuel: error:") and "no-such-model" in err and err.count("\n") == 1


@pytest.mark.parametrize(("flag", "value"), [("--port", "70000"), ("--slots", "0"), ("--max-queue", "-1"),
                                             ("--context", "x"), ("--embedding-model", "bert"),
                                             ("--prompt-rows", "16")])
def test_bad_options_are_argparse_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err
