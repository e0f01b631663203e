"""The OpenAI-compatible HTTP app over an `Engine`: `create_app(engine, embedder=...)` gives a Starlette app.

Routes: `POST /v1/chat/completions` and `POST /v1/completions` (server-sent events when `stream` is true:
`data: {json}\\n\\n` chunks, then `data: [DONE]\\n\\n`), `POST /v1/embeddings`, `GET /v1/models` (and
`/v1/models/{id}`), `GET /health`, `GET /metrics` (Prometheus text), and llama-server's `POST /tokenize`
(`{"content", "add_special"}` -> `{"tokens"}`) and `POST /detokenize` (`{"tokens"}` -> `{"content"}`).

Every error is OpenAI's JSON `{"error": {"message", "type", "param", "code"}}`: 400 for a body that is not
JSON and for every parameter that is wrong (`fuel.serve.protocol`), 404 for an unknown model or route, 405
for a wrong method, 413 for a body past `MAX_BODY`, 429 with `Retry-After` when the engine's queue is
full. Client input never gives a 5xx: a 500 means a fault of the server, and is logged with its traceback.

A request whose client goes away before its end, streamed or not, is cancelled (`Stream.cancel()`), which
frees its KV blocks at the engine's next step; so is a request whose handler fails.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from fuel.errors import FuelError, ParamError
from fuel.serve import metrics
from fuel.serve.protocol import (
    ApiError,
    BadRequest,
    NotFound,
    Parsed,
    boolean,
    check_keys,
    parse_chat,
    parse_completion,
    show,
    vocab_of,
)
from fuel.serve.responses import Builder, now

if TYPE_CHECKING:
    from fuel.serve.engine import Engine, Stream

log = logging.getLogger("fuel.serve")

MAX_BODY = 16 << 20  # bytes of one request body
MAX_EMBED_INPUTS = 2048  # OpenAI's bound on one embeddings request
RETRY_AFTER_S = 1
EMBEDDING_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm")


class Embedder(Protocol):
    """What `/v1/embeddings` needs of a model (fuel.models.bert.MiniLM)."""

    def embed(self, sentences: Sequence[str], *, normalize: bool = True, batch_size: int = 32) -> np.ndarray: ...

    def token_ids(self, sentences: Sequence[str]) -> list[list[int]]: ...


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class TooLarge(ApiError):
    status = 413
    kind = "invalid_request_error"


class Busy(ApiError):
    status = 429
    kind = "rate_limit_error"


async def read_json(request: Request) -> Any:
    body = await request.body()
    if len(body) > MAX_BODY:
        raise TooLarge(f"the request body has {len(body)} bytes, more than {MAX_BODY}", code="body_too_large")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and undecodable bytes are ValueErrors
        raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None


class _SSE(StreamingResponse):
    """Server-sent events of one generation; however the response ends (the client gone included), an
    unfinished stream is cancelled."""

    def __init__(self, events: AsyncIterator[bytes], stream: Stream, state: dict[str, bool]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream, self.state = stream, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.state["done"]:
                self.stream.cancel()


async def _cancel_on_disconnect(request: Request, stream: Stream) -> None:
    """Cancel `stream` when the client of a non-streamed request goes away (its body is read already, so
    the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.cancel()


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def create_app(engine: Engine, *, embedder: Embedder | None = None) -> Starlette:
    """The app serving `engine` (and `embedder`'s embeddings, if given; else `/v1/embeddings` is a 404)."""
    from fuel.serve.engine import Done, QueueFull

    http = metrics.HttpCounts()
    registry = metrics.registry(engine, http)
    compiler: list[Any] = []
    compiler_lock, embed_lock = threading.Lock(), threading.Lock()

    def compile_grammar(response_format: Any) -> Any:
        with compiler_lock:
            if not compiler:
                from fuel.serve.grammar import GrammarCompiler

                compiler.append(GrammarCompiler(engine.tokenizer, int(engine.llm.model.cfg.vocab)))
        return compiler[0].compile(response_format)

    def api(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as e:
                response = error_response(e)
            except QueueFull as e:
                response = error_response(Busy(f"the server is busy: {e}", code="queue_full"),
                                          {"Retry-After": str(RETRY_AFTER_S)})
            except ParamError as e:  # a check past the protocol's (the engine's, the embedder's): the input
                response = error_response(BadRequest(str(e), code="invalid_value"))
            except Exception:
                log.exception("fuel serve: %s %s failed", request.method, request.url.path)
                response = error_response(ApiError("the server failed to answer; see its log"))
            http.add(response.status_code)
            return response
        return wrapped

    async def generate(request: Request, parse: Callable[..., Parsed], chat: bool) -> Response:
        body = await read_json(request)
        if isinstance(body, dict) and body.get("response_format") is not None:  # compiling may take a while
            parsed = await run_in_threadpool(parse, body, engine, compile_grammar)
        else:
            parsed = parse(body, engine, compile_grammar)
        stream = engine.submit(parsed.request, loop=asyncio.get_running_loop())
        builder = Builder(chat, parsed.model, engine.tokenizer, parsed.request.logprobs is not None)
        state = {"done": False}
        if parsed.stream:
            return _SSE(_events(stream, builder, parsed.include_usage, state), stream, state)
        texts: list[str] = []
        lps: list[Any] = []
        watcher = asyncio.create_task(_cancel_on_disconnect(request, stream))
        try:
            async for item in stream:
                if isinstance(item, Done):
                    state["done"] = True
                    if item.error is not None:
                        raise ApiError(f"the generation failed: {item.error}", code="generation_failed")
                    return JSONResponse(builder.whole("".join(texts), lps, item))
                texts.append(item.text)
                lps.extend(item.logprobs)
            raise ApiError("the engine's stream ended without its Done", code="generation_failed")
        finally:
            watcher.cancel()
            if not state["done"]:
                stream.cancel()

    async def _events(stream: Stream, builder: Builder, include_usage: bool,
                      state: dict[str, bool]) -> AsyncIterator[bytes]:
        first = builder.first()
        if first is not None:
            yield _event(first)
        async for item in stream:
            if isinstance(item, Done):
                state["done"] = True
                if item.error is not None:
                    log.error("fuel serve: a streamed generation failed: %s", item.error)
                    yield _event(ApiError(f"the generation failed: {item.error}", code="generation_failed").body())
                else:
                    yield _event(builder.last(item))
                    if include_usage:
                        yield _event(builder.usage_chunk(item))
                yield b"data: [DONE]\n\n"
                return
            if item.text or item.logprobs:
                yield _event(builder.piece(item.text, item.logprobs))
        log.error("fuel serve: the engine's stream ended without its Done")

    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat, True)

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion, False)

    async def embeddings(request: Request) -> Response:
        body = check_keys(await read_json(request), frozenset({"input", "model", "encoding_format", "dimensions",
                                                               "user"}), "embeddings")
        if embedder is None:
            raise NotFound("no embedding model is loaded; start the server with --embedding-model minilm",
                           param="model", code="model_not_found")
        model = body.get("model", EMBEDDING_NAMES[0])
        if model not in EMBEDDING_NAMES:
            raise NotFound(f"the embedding model {show(model)} does not exist; this server serves "
                           f"{EMBEDDING_NAMES[0]!r}", param="model", code="model_not_found")
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if not (isinstance(inputs, list) and 0 < len(inputs) <= MAX_EMBED_INPUTS
                and all(isinstance(s, str) and s for s in inputs)):
            raise BadRequest(f"input must be a non-empty string or an array of 1 to {MAX_EMBED_INPUTS} of them, "
                             f"got {show(body.get('input'))}", param="input", code="invalid_value")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise BadRequest(f"encoding_format must be 'float' or 'base64', got {show(fmt)}",
                             param="encoding_format", code="invalid_value")

        def run() -> tuple[np.ndarray, int]:
            with embed_lock:  # one embedding batch at a time: the model's captures are its own
                return embedder.embed(inputs), sum(len(t) for t in embedder.token_ids(inputs))

        vectors, n_tokens = await run_in_threadpool(run)
        dims = body.get("dimensions")
        if dims is not None and dims != vectors.shape[1]:
            raise BadRequest(f"dimensions must be {vectors.shape[1]} (this model's), got {show(dims)}",
                             param="dimensions", code="invalid_value")
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
                               else v.astype(np.float32).tolist())} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    def model_cards() -> list[dict[str, Any]]:
        names = [engine.model_name] + ([EMBEDDING_NAMES[0]] if embedder is not None else [])
        return [{"id": n, "object": "model", "created": started, "owned_by": "fuel"} for n in names]

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": model_cards()})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        for card in model_cards():
            if card["id"] == name:
                return JSONResponse(card)
        raise NotFound(f"the model {name!r} does not exist", param="model", code="model_not_found")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def scrape(request: Request) -> Response:
        return Response(metrics.scrape(registry), media_type=metrics.CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        body = check_keys(await read_json(request), frozenset({"content", "add_special"}), "tokenize")
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest(f"content must be a string, got {show(content)}", param="content", code="invalid_value")
        tok = engine.tokenizer
        try:
            ids = tok.encode(content, add_bos=tok.add_bos and boolean(body, "add_special"))
        except FuelError as e:
            raise BadRequest(f"content: {e}", param="content", code="invalid_value") from e
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = check_keys(await read_json(request), frozenset({"tokens"}), "detokenize")
        ids, vocab = body.get("tokens"), vocab_of(engine)
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                              for t in ids)):
            raise BadRequest(f"tokens must be an array of token ids in [0, {vocab}), got {show(ids)}",
                             param="tokens", code="invalid_value")
        return JSONResponse({"content": engine.tokenizer.decode(ids)})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = ApiError(f"{request.method} {request.url.path}: {exc.detail}", code=code)
        err.status, err.kind = exc.status_code, "invalid_request_error"
        http.add(exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    started = now()
    routes = [Route("/v1/chat/completions", api(chat_completions), methods=["POST"]),
              Route("/v1/completions", api(completions), methods=["POST"]),
              Route("/v1/embeddings", api(embeddings), methods=["POST"]),
              Route("/v1/models", api(models), methods=["GET"]),
              Route("/v1/models/{name:path}", api(model), methods=["GET"]),
              Route("/health", api(health), methods=["GET"]),
              Route("/metrics", api(scrape), methods=["GET"]),
              Route("/tokenize", api(tokenize), methods=["POST"]),
              Route("/detokenize", api(detokenize), methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.engine, app.state.http = engine, http
    return app
