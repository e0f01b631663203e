"""fuel.serve.ray on a local Ray cluster of 2 CPUs, shared by this session's tests.

Ray Data: the embeddings of `embed_dataset` and of `fuel embed --ray` equal the single-process
`fuel.models.bert.embed`'s bit for bit (each sentence's row is computed independently of its batch, so the
split into Ray batches and actors must not show).

Ray Serve: 2 replicas of one CPU each, reached through Ray Serve's HTTP proxy on 127.0.0.1 with the openai
client, answer greedy chat completions, streamed and not, exactly as a single-process server of the same
app and engine does. The deployment lives for its test class only, so that the Ray Data tests find the
cluster's 2 CPUs free.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import ray
from ray import serve

from fuel.cli import EXIT_INTERRUPTED, main
from fuel.errors import ParamError
from fuel.models import bert
from fuel.serve.engine import PROMPT_STEP_ROWS
from fuel.serve.ray import ReplicaSpec, app_builder, application, embed_dataset, embed_texts, threads_for

MODEL, CONTEXT, SLOTS = "smollm2", 256, 2
STARTUP_S = 600  # replicas load the model; a first run compiles the batched step's kernels (cached after)
CHATS = [[{"role": "user", "content": "Name three fruits."}], [{"role": "user", "content": "What is 2 + 3?"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}]]

# Mixed lengths (so Ray's batches pad differently from the single-process ones), repeated texts, an empty one.
SENTENCES = [f"{i}: " + " ".join(["fuel", "serves", "tokens", "on", "ray"][: i % 6]) + " ünïcödé 🚀" * (i % 3)
             for i in range(20)] + ["", "A cat.", "A cat."]


def interruptible() -> None:
    """Ctrl-C's default action in the child (a suite run in the background starts with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_running() -> bool:
    return any(a["name"] == "SERVE_CONTROLLER_ACTOR" for a in ray.util.list_named_actors(all_namespaces=True))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _answers(url: str) -> list[tuple[str, str, int]]:
    """Each chat's greedy answer (8 tokens), non-streamed and streamed, and its chunk count; the chats are
    sent concurrently, so that both replicas of a deployment serve some."""
    c = _client(url)

    def ask(messages: Any) -> tuple[str, str, int]:
        whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                stream=True))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return whole.choices[0].message.content or "", streamed, len(chunks)

    with ThreadPoolExecutor(len(CHATS)) as pool:
        return list(pool.map(ask, CHATS))


@pytest.fixture(scope="module")
def single_process() -> Iterator[list[tuple[str, str, int]]]:
    """The answers of `fuel serve`'s app and engine in this process, under uvicorn on 127.0.0.1."""
    import uvicorn

    from fuel.models.generate import load
    from fuel.serve.app import create_app
    from fuel.serve.engine import Engine

    engine = Engine(load(MODEL, context=CONTEXT), slots=SLOTS, model_name=MODEL)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield _answers(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}")
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()


class TestServeReplicas:
    @pytest.fixture(scope="class")
    def proxy(self, cluster: None) -> Iterator[str]:
        """`fuel serve --ray-replicas 2` joining this session's cluster through RAY_ADDRESS; interrupted (as
        Ctrl-C does) it shuts Ray Serve down."""
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        log = Path(tempfile.mkstemp(prefix="fuel-ray-serve-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fuel", "serve", "--ray-replicas", "2", "--ray-cpus", "1",
                                     "--model", MODEL, "--context", str(CONTEXT), "--slots", str(SLOTS),
                                     "--max-queue", "4", "--host", "127.0.0.1", "--port", str(port)],
                                    env=env, stdout=out, stderr=out, preexec_fn=interruptible)
        try:
            deadline = time.time() + STARTUP_S
            while True:
                assert proc.poll() is None, f"fuel serve --ray-replicas exited {proc.returncode}:\n{log.read_text()}"
                assert time.time() < deadline, f"no answer in {STARTUP_S} s:\n{log.read_text()}"
                if "Ray Serve replicas of" in log.read_text():  # deployed: every replica is up
                    break
                time.sleep(0.5)
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            yield url
            proc.send_signal(signal.SIGINT)
            assert proc.wait(150) == EXIT_INTERRUPTED, log.read_text()  # Ray Serve shuts its replicas down first
            assert not _serve_running()  # the command shut Ray Serve down on its way out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if _serve_running():
                serve.shutdown()
            log.unlink()

    def test_replicas_answer_as_the_single_process_server(self, proxy: str,
                                                           single_process: list[tuple[str, str, int]]) -> None:
        states = serve.status().applications["fuel"].deployments["FuelReplica"].replica_states
        assert states == {"RUNNING": 2}
        answers = _answers(proxy)
        assert answers == single_process
        for whole, streamed, chunks in answers:
            assert whole and streamed == whole and chunks >= 3  # the SSE chunks pass the proxy one by one

    def test_the_app_routes_and_errors_pass_the_proxy(self, proxy: str) -> None:
        c = _client(proxy)
        assert [m.id for m in c.models.list()] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=CHATS[0], max_tokens=4)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="temperature"):
            c.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=-1)  # type: ignore[arg-type]


def test_app_builder_takes_serve_runs_arguments() -> None:
    """`serve run fuel.serve.ray:app_builder key=value ...` hands the builder the values as strings."""
    deployment = app_builder({"model": "gemma3", "replicas": "3", "num_cpus": "0.5", "embeddings": "true",
                              "slots": "2", "max_queue": "0", "context": "512", "prompt_rows": "64"})._bound_deployment
    assert deployment.name == "FuelReplica" and deployment.num_replicas == 3
    assert deployment.ray_actor_options == {"num_cpus": 0.5} and deployment.max_ongoing_requests == 2
    assert deployment.init_args == (ReplicaSpec("gemma3", 512, 2, 0, True, 0.5, 64),)
    assert ReplicaSpec.prompt_rows == PROMPT_STEP_ROWS  # the engine's default, written out for Ray's CLI
    assert threads_for(0.5) == 1 and threads_for(3.0) == 3


def test_application_arguments_are_checked() -> None:
    with pytest.raises(ParamError, match=r"fuel\.serve\.ray: replicas must be a positive int, got 0"):
        application(replicas=0)
    with pytest.raises(ParamError, match=r"fuel\.serve\.ray: num_cpus must be a positive number, got -1"):
        application(num_cpus=-1)
    with pytest.raises(ParamError, match=r"fuel\.serve\.ray: max_queue must be an int >= 0, got -2"):
        application(max_queue=-2)
    with pytest.raises(ParamError, match=r"fuel\.serve\.ray: prompt_rows must be at least 32, got 8"):
        application(prompt_rows=8)
    with pytest.raises(ParamError, match=r"fuel\.serve\.ray: unknown argument 'replica'; expected some of"):
        app_builder({"replica": "2"})
    with pytest.raises(ParamError, match="invalid literal for int"):
        app_builder({"replicas": "two"})
