"""gguf_decode's choice of decode kernels: each kind of host's (`HOST_WAYS`), forced and restored by
`host_way`, and every one of them compiled by `fuel compile`."""

from __future__ import annotations

import numpy as np
import pytest

from fuel.cpu.quant import gguf_decode
from fuel.quant import QuantType
from fuel.testing import precompile


def _choice() -> tuple[dict[QuantType, tuple[object, ...]], bool, bool]:
    return dict(gguf_decode.TABLE_KERNELS), gguf_decode.USE_TABLES, gguf_decode.USE_WORDS


@pytest.mark.parametrize("name", list(gguf_decode.HOST_WAYS))
def test_host_way_sets_that_hosts_choice_and_restores_this_ones(name: str) -> None:
    before = _choice()
    tables, words = gguf_decode.HOST_WAYS[name]
    with pytest.raises(RuntimeError, match="inside"), gguf_decode.host_way(name):
        assert gguf_decode.TABLE_KERNELS is tables and gguf_decode.USE_WORDS is words
        assert bool(tables) == gguf_decode.USE_TABLES
        raise RuntimeError("inside")
    after = _choice()
    assert after[1:] == before[1:] and after[0].keys() == before[0].keys()
    assert all(after[0][qt][:2] == before[0][qt][:2] for qt in after[0])


def test_this_hosts_own_choice_is_one_of_the_host_ways() -> None:
    own = {qt: t[:2] for qt, t in gguf_decode.TABLE_KERNELS.items()}
    ways = [{qt: t[:2] for qt, t in tables.items()} for tables, _ in gguf_decode.HOST_WAYS.values()]
    assert own in ways
    for tables, _ in gguf_decode.HOST_WAYS.values():  # each table kernel reads its activations in its order
        for qt, (_, _, order) in tables.items():
            assert np.array_equal(np.sort(order), np.arange(len(order))), (qt, order)


def test_fuel_compile_runs_qmatmuls_cases_as_every_host_decodes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr("fuel.testing.contract.output_for",
                        lambda *args: seen.append((gguf_decode.USE_TABLES, gguf_decode.USE_WORDS,
                                                   frozenset(gguf_decode.TABLE_KERNELS))))
    unit = next(u for u in precompile.units() if u.name.startswith("QMatMul["))
    _, _, run = precompile._impl_cases(unit.index)
    run(precompile._impl_cases(unit.index)[1][unit.start])
    want = [(gguf_decode.USE_TABLES, gguf_decode.USE_WORDS, frozenset(gguf_decode.TABLE_KERNELS))]
    want += [(bool(t), w, frozenset(t)) for t, w in gguf_decode.HOST_WAYS.values()]
    assert seen == want
    assert precompile._other_hosts("FlashAttn") == []
