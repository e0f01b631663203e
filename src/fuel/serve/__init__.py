"""`fuel serve`: an OpenAI-compatible server over a continuously batched engine (install the `serve` extra).

The engine (`fuel.serve.engine`) runs every active request's tokens in one batched step on a paged KV cache
(`fuel.serve.kv_blocks`, `fuel.serve.batch_model`); the Starlette app (`fuel.serve.app`) speaks OpenAI's
HTTP API over it; `fuel.serve.ray` deploys the same app as Ray Serve replicas.
"""
