"""Scale-out on Ray (install the `ray` extra): Ray Data embeddings of large corpora, Ray Serve replicas.

Ray Data. `embed_dataset(ds, column="text")` maps a dataset's text column to MiniLM embeddings with
`ds.map_batches(Embedder, concurrency=k)`: `Embedder` is a callable class, so each of the k actors loads
the model once and keeps its captures across batches. Fuel's kernels compute every sentence's row
independently of the others in its batch, so the rows equal `fuel.models.bert.embed`'s bit for bit,
whichever actor and batch a sentence lands in. `embed_texts` is the `fuel embed --ray` path: a list of
sentences in, the `[n, 384]` array out, in input order.

Ray Serve. `application(...)` is a Ray Serve application of N replicas of `FuelReplica`: each loads its own
model, runs its own `Engine` (continuous batching over its slots) and serves the very app `fuel serve` runs
(`fuel.serve.app.create_app`), built in the replica through Ray Serve's late-bound ASGI ingress
(`__serve_build_asgi_app__`). Ray Serve's HTTP proxy routes each request to a replica and passes the app's
streamed (SSE) responses through as they are written. `deploy(...)` starts it on the connected cluster;
`serve run fuel.serve.ray:app_builder model=smollm2 replicas=4` does the same from Ray's own CLI; and
`fuel serve --ray-replicas N` from fuel's.

Every actor and replica sets fuel's thread count to the CPUs Ray reserves for it, so the replicas of a
machine share its cores instead of each spinning a pool as wide as the machine.

`ray.init()` (called here only when no cluster is connected) joins the cluster named by `RAY_ADDRESS`, or
starts a local one: the same code runs on a laptop and on a cluster.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

import fuel as fl
from fuel.errors import FuelError, ParamError

if TYPE_CHECKING:
    import ray.data
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle
    from starlette.applications import Starlette

INSTALL_HINT = "pip install 'fuel[ray]'"


class RayNotInstalled(FuelError, ImportError):
    """The `ray` extra is missing."""


def _ray() -> Any:
    try:
        # ray.data and ray.serve are subpackages, bound as attributes of ray once imported.
        import ray
        import ray.data
        import ray.serve
    except ImportError:
        raise RayNotInstalled(f"fuel.serve.ray: Ray is not installed; run: {INSTALL_HINT}") from None
    return ray


def _connect() -> None:
    """Joins `RAY_ADDRESS`'s cluster, or starts a local one, unless this process is connected already."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)


def _positive_int(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParamError(f"{op}: {name} must be a positive int, got {value!r}")
    return value


def _cpus(op: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ParamError(f"{op}: num_cpus must be a positive number, got {value!r}")
    return float(value)


def threads_for(num_cpus: float) -> int:
    """Fuel's thread count in an actor that Ray gives `num_cpus` CPUs (at least one thread)."""
    return max(1, int(num_cpus))


class Embedder:
    """Ray Data's callable class for `map_batches`: one MiniLM per actor, loaded once, fuel's threads set
    to the actor's CPUs. A batch (`{column: array of str, ...}`) comes back with `output_column` added:
    a `[rows, 384]` float32 array; the batch's other columns pass through."""

    def __init__(self, column: str = "text", output_column: str = "embedding", *, normalize: bool = True,
                 batch_size: int = 32, threads: int = 1) -> None:
        from fuel.models import bert

        fl.set_num_threads(threads)
        self.column, self.output_column = column, output_column
        self.normalize, self.batch_size = normalize, batch_size
        self.model = bert.load()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.column not in batch:
            raise ParamError(f"embed_dataset: a batch has no column {self.column!r}; it has {sorted(batch)}")
        sentences = list(batch[self.column])
        emb = self.model.embed(sentences, normalize=self.normalize, batch_size=self.batch_size)
        return {**batch, self.output_column: emb}


def embed_dataset(ds: ray.data.Dataset, column: str = "text", *, output_column: str = "embedding",
                  concurrency: int = 2, num_cpus: float = 1, batch_size: int = 256, embed_batch_size: int = 32,
                  normalize: bool = True) -> ray.data.Dataset:
    """`ds` with `output_column` added: each row's MiniLM embedding of its `column` (a `[384]` float32
    tensor column), computed lazily by `concurrency` actors of `num_cpus` CPUs each, `batch_size` rows per
    Ray batch and `embed_batch_size` sentences per encoder call. `ds` itself is not changed."""
    op = "embed_dataset"
    concurrency = _positive_int(op, "concurrency", concurrency)
    batch_size = _positive_int(op, "batch_size", batch_size)
    embed_batch_size = _positive_int(op, "embed_batch_size", embed_batch_size)
    cpus = _cpus(op, num_cpus)
    columns = ds.columns(fetch_if_missing=False)  # known without running the dataset, or checked per batch
    if columns is not None:
        if column not in columns:
            raise ParamError(f"{op}: the dataset has no column {column!r}; its columns are {columns}")
        if output_column in columns:
            raise ParamError(f"{op}: the dataset already has a column {output_column!r}; "
                             "name another output_column")
    return ds.map_batches(
        Embedder, batch_format="numpy", batch_size=batch_size, concurrency=concurrency, num_cpus=cpus,
        fn_constructor_kwargs={"column": column, "output_column": output_column, "normalize": normalize,
                               "batch_size": embed_batch_size, "threads": threads_for(cpus)})


def embed_texts(sentences: Sequence[str], *, concurrency: int = 2, num_cpus: float = 1, batch_size: int = 256,
                embed_batch_size: int = 32, normalize: bool = True) -> np.ndarray:
    """`fuel.models.bert.embed(sentences)` computed on Ray (`embed_dataset`): `[n, 384]` float32, the rows in
    the order of `sentences`. Connects to Ray first if this process is not connected."""
    op = "embed_texts"
    if isinstance(sentences, str):
        raise ParamError(f"{op}: expects a sequence of sentences, got one str; wrap it in a list")
    bad = [type(s).__name__ for s in sentences if not isinstance(s, str)]
    if bad:
        raise ParamError(f"{op}: every sentence must be a str, got a {bad[0]}")
    if not sentences:
        return np.empty((0, 384), np.float32)  # MiniLM's width, without loading the model
    _connect()
    ds = _ray().data.from_items([{"index": i, "text": s} for i, s in enumerate(sentences)])
    mapped = embed_dataset(ds, "text", concurrency=concurrency, num_cpus=num_cpus, batch_size=batch_size,
                           embed_batch_size=embed_batch_size, normalize=normalize)
    # Ray Data does not keep the input order by default: each row carries its index back.
    parts = [(b["index"], b["embedding"]) for b in mapped.iter_batches(batch_format="numpy", batch_size=None)]
    index = np.concatenate([i for i, _ in parts])
    if len(index) != len(sentences) or not np.array_equal(np.sort(index), np.arange(len(sentences))):
        raise FuelError(f"{op}: Ray Data returned {len(index)} rows for {len(sentences)} sentences")
    out = np.empty((len(sentences), parts[0][1].shape[1]), np.float32)
    out[index] = np.concatenate([e for _, e in parts])
    return out


# ---- Ray Serve ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads and how it serves: `fuel serve`'s options, and the CPUs Ray reserves for it."""

    model: str = "smollm2"
    context: int = 2048
    slots: int = 4
    max_queue: int = 64
    embeddings: bool = False  # serve /v1/embeddings with MiniLM
    num_cpus: float = 1
    prompt_rows: int = 256  # the engine's PROMPT_STEP_ROWS (tests/serve/test_ray.py checks they agree)

    def checked(self) -> ReplicaSpec:
        op = "fuel.serve.ray"
        if not isinstance(self.model, str) or not self.model:
            raise ParamError(f"{op}: model must be a model name or a .gguf path, got {self.model!r}")
        for name in ("context", "slots", "prompt_rows"):
            _positive_int(op, name, getattr(self, name))
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ParamError(f"{op}: max_queue must be an int >= 0, got {self.max_queue!r}")
        from fuel.serve.engine import SMALLEST_BUCKET

        if self.prompt_rows < SMALLEST_BUCKET:
            raise ParamError(f"{op}: prompt_rows must be at least {SMALLEST_BUCKET}, got {self.prompt_rows}")
        _cpus(op, self.num_cpus)
        return self


class FuelReplica:
    """One Ray Serve replica: its own model, engine, embedder and fuel threads; the app of `fuel serve`."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from fuel.models.generate import load
        from fuel.serve.engine import Engine
        from fuel.serve.serve_cli import served_name

        fl.set_num_threads(threads_for(spec.num_cpus))
        self.engine = Engine(load(spec.model, context=spec.context), slots=spec.slots, max_queue=spec.max_queue,
                             model_name=served_name(spec.model), prompt_rows=spec.prompt_rows)
        self.embedder: Any = None
        if spec.embeddings:
            from fuel.models import bert

            self.embedder = bert.load()

    def __serve_build_asgi_app__(self) -> Starlette:
        from fuel.serve.app import create_app

        return create_app(self.engine, embedder=self.embedder)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def application(model: str = "smollm2", *, replicas: int = 2, num_cpus: float = 1, context: int = 2048,
                slots: int = 4, max_queue: int = 64, embeddings: bool = False,
                prompt_rows: int = ReplicaSpec.prompt_rows) -> Application:
    """The Ray Serve application: `replicas` copies of `FuelReplica`, each reserving `num_cpus` CPUs (and
    running fuel on as many threads). A replica takes up to slots + max_queue requests at once, so that
    its engine queues them and answers 429 past its bound, as `fuel serve` does."""
    serve = _ray().serve
    spec = ReplicaSpec(model, context, slots, max_queue, embeddings, num_cpus, prompt_rows).checked()
    replicas = _positive_int("fuel.serve.ray", "replicas", replicas)
    deployment = serve.deployment(name="FuelReplica", num_replicas=replicas, max_ongoing_requests=slots + max_queue,
                                  ray_actor_options={"num_cpus": float(num_cpus)})
    return deployment(serve.ingress()(FuelReplica)).bind(spec)


def app_builder(args: Mapping[str, str]) -> Application:
    """For Ray's CLI: `serve run fuel.serve.ray:app_builder model=smollm2 replicas=2 num_cpus=1 ...` (the
    keys are `application`'s arguments; `embeddings=1` serves /v1/embeddings)."""
    kinds = {f.name: f.type for f in fields(ReplicaSpec)} | {"replicas": "int"}
    unknown = sorted(set(args) - set(kinds))
    if unknown:
        raise ParamError(f"fuel.serve.ray: unknown argument {unknown[0]!r}; expected some of {sorted(kinds)}")
    parse: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float,
                                              "bool": lambda v: v.lower() in ("1", "true", "yes")}
    try:
        kw = {k: parse[str(kinds[k])](v) for k, v in args.items()}
    except ValueError as e:
        raise ParamError(f"fuel.serve.ray: {e}") from None
    return application(**kw)


def deploy(model: str = "smollm2", *, replicas: int = 2, num_cpus: float = 1, context: int = 2048, slots: int = 4,
           max_queue: int = 64, embeddings: bool = False, prompt_rows: int = ReplicaSpec.prompt_rows,
           host: str = "127.0.0.1", port: int = 8000, name: str = "fuel", route_prefix: str = "/") -> DeploymentHandle:
    """Deploys `application(...)` on the connected cluster (connecting first if needed) behind Ray Serve's
    HTTP proxy on host:port, and returns once every replica is up. `serve.delete(name)` removes it."""
    app = application(model, replicas=replicas, num_cpus=num_cpus, context=context, slots=slots,
                      max_queue=max_queue, embeddings=embeddings, prompt_rows=prompt_rows)
    _connect()
    serve = _ray().serve
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name=name, route_prefix=route_prefix, blocking=False)


def add_serve_ray_arguments(p: argparse.ArgumentParser) -> None:
    from fuel.arg_types import number

    p.add_argument("--ray-replicas", type=number(int, 0, what="an integer >= 0"), default=0,
                   help="serve through Ray Serve with this many replicas, each with its own model and engine, in "
                        "the cluster named by RAY_ADDRESS, else a local one (the ray extra; default 0: no Ray)")
    p.add_argument("--ray-cpus", type=number(float, 0, low_open=True, what="a number > 0"), default=1,
                   help="with --ray-replicas: CPUs Ray reserves for each replica, and its fuel threads (default 1)")


def run_serve_ray(args: argparse.Namespace) -> int:
    """`fuel serve --ray-replicas N`: `fuel serve`'s options deployed as N Ray Serve replicas of
    --ray-cpus CPUs each, until interrupted (even while deploying); then Ray Serve is shut down."""
    ray = _ray()
    try:
        deploy(args.model, replicas=args.ray_replicas, num_cpus=args.ray_cpus, context=args.context,
               slots=args.slots, max_queue=args.max_queue, embeddings=args.embedding_model == "minilm",
               prompt_rows=args.prompt_rows or ReplicaSpec.prompt_rows, host=args.host, port=args.port)
        print(f"fuel serve: {args.ray_replicas} Ray Serve replicas of {args.model} on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        while True:  # until Ctrl-C: `fuel` answers it with its interrupted status
            time.sleep(3600)
    finally:
        if ray.is_initialized():
            ray.serve.shutdown()
