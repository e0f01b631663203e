"""fuel.serve.ray on a local Ray cluster of 2 CPUs, shared by this session's tests.

Ray Data: the embeddings of `embed_dataset` and of `fuel embed --ray` equal the single-process
`fuel.models.bert.embed`'s bit for bit (each sentence's row is computed independently of its batch, so the
split into Ray batches and actors must not show).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

from fuel.cli import main
from fuel.errors import ParamError
from fuel.models import bert
from fuel.serve.ray import embed_dataset, embed_texts

# Mixed lengths (so Ray's batches pad differently from the single-process ones), repeated texts, an empty one.
SENTENCES = [f"{i}: " + " ".join(["fuel", "serves", "tokens", "on", "ray"][: i % 6]) + " ünïcödé 🚀" * (i % 3)
             for i in range(20)] + ["", "A cat.", "A cat."]


@pytest.fixture(scope="session")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single() -> np.ndarray:
    return bert.embed(SENTENCES)


def test_embed_dataset_is_bit_equal_to_embed(cluster: None, single: np.ndarray) -> None:
    ds = ray.data.from_items([{"id": i, "text": s} for i, s in enumerate(SENTENCES)])
    out = embed_dataset(ds, concurrency=2, num_cpus=1, batch_size=4, embed_batch_size=3)
    rows = sorted(out.take_all(), key=lambda r: int(r["id"]))
    assert [r["text"] for r in rows] == SENTENCES  # the other columns pass through
    got = np.stack([r["embedding"] for r in rows])
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
    assert np.array_equal(got, single)
    assert ds.columns() == ["id", "text"]  # the input dataset is unchanged


def test_cli_embed_ray_writes_the_same_npy(cluster: None, single: np.ndarray, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(s for s in SENTENCES if s) + "\n", encoding="utf-8")
    out = tmp_path / "emb.npy"
    assert main(["embed", "--ray", "--ray-workers", "2", "--file", str(corpus), "--out", str(out),
                 "--batch-size", "5"]) == 0
    kept = [i for i, s in enumerate(SENTENCES) if s]  # --file skips blank lines
    assert np.array_equal(np.load(out), single[kept])  # in the file's order


def test_embed_dataset_bad_arguments(cluster: None) -> None:
    ds = ray.data.from_items([{"sentence": "a"}])
    missing = r"embed_dataset: the dataset has no column 'text'; its columns are \['sentence'\]"
    with pytest.raises(ParamError, match=missing):
        embed_dataset(ds)
    with pytest.raises(ParamError, match="embed_dataset: the dataset already has a column 'sentence'"):
        embed_dataset(ds, "sentence", output_column="sentence")
    for kw, msg in (({"concurrency": 0}, "concurrency must be a positive int, got 0"),
                    ({"batch_size": True}, "batch_size must be a positive int, got True"),
                    ({"num_cpus": float("nan")}, "num_cpus must be a positive number, got nan")):
        with pytest.raises(ParamError, match=f"embed_dataset: {msg}"):
            embed_dataset(ds, "sentence", **kw)
    with pytest.raises(ParamError, match="embed_texts: every sentence must be a str, got a int"):
        embed_texts(["a", 3])  # type: ignore[list-item]
    with pytest.raises(ParamError, match="embed_texts: expects a sequence of sentences, got one str"):
        embed_texts("a sentence")
    assert embed_texts([]).shape == (0, 384)
