"""Serving: `fuel serve` against llama.cpp's `llama-server` and the llama-cpp-python server, in one run.

Each engine serves the bundled SmolLM2-135M-Instruct GGUF (Q4_1) on 127.0.0.1 with 2 threads, started as a
subprocess for each concurrency C in (1, 4, 8), one server at a time:

- fuel: `fuel serve --slots C --context 512` (its thread count is the machine's, 2 here);
- llama-server (built by `make bench-env`): `-np C -c C*512 -t 2 -tb 2 --cont-batching`, 512 tokens a slot;
- llama-cpp-python's server (`make bench-env` installs its extra): `--n_threads 2 --interrupt_requests False`;
  it serves one request at a time, so its clients queue (by default a new request would cut off the running
  stream instead).

After /health (or /v1/models) answers, C warm-up requests run at once, then C clients each send `requests`
streamed chat/completions requests one after another (`serve_load`): a 128-token prompt (the chat template
included; every prompt differs from its first tokens on, so no prefix cache flatters anyone) and 128 output
tokens, greedy. Every request runs to 128 tokens: `ignore_eos` for fuel and llama-server, `min_tokens` 128
for llama-cpp-python (it has no ignore_eos; min_tokens masks EOS until then).

Reported per engine and C: aggregate output tokens/s, TTFT p50/p99 and inter-token latency p50/p99, each
the median of `rounds` rounds with its spread (min, max); the engines' order alternates round to round.
The ratios fuel/peer and the issue's targets come with them: fuel at C=4 gives >= 2.5x its own tokens/s
at C=1; at C=4 and C=8, fuel gives >= 2x llama-server's tokens/s, with TTFT and ITL p50/p99 no worse.
Servers run without the OpenBLAS variables this machine sets and without OMP_WAIT_POLICY (as `make bench`).
Run it through `fuel bench --serve` or `python -m benchmarks.bench_serve`; JSON and PNG go to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import serve_load

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
SLOT_CONTEXT = 512  # llama-server's context per slot: 128 prompt + 128 output tokens with room to spare
ENGINES = ("fuel", "llama_server", "llama_cpp_python")
PEERS = ENGINES[1:]
LLAMA_SERVER = ROOT / "bench-env" / "llama-server" / "bin" / "llama-server"
BUILD_HINT = "build it with `make bench-env`"
METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
TEXT = ("The history of the printing press begins in the fifteenth century, when movable metal type made "
        "books cheap enough for ordinary readers. Within fifty years presses ran in hundreds of towns, and "
        "the spread of pamphlets, maps and scientific tables changed how ideas travelled across Europe. ")


@dataclass(frozen=True)
class Sizes:
    prompt: int = 128  # tokens, chat template included
    output: int = 128
    requests: int = 4  # per client
    rounds: int = 3
    concurrency: tuple[int, ...] = (1, 4, 8)
    warmup_tokens: int = 8
    start_timeout_s: float = 300.0


# ---- prompts and requests ----------------------------------------------------------------------------


def prompt_messages(tag: str, n_tokens: int) -> list[dict[str, str]]:
    """Chat messages whose prompt (SmolLM2's template, from the GGUF's own tokenizer) is n_tokens long, or
    as close below as the text allows. `tag` leads the system message, so prompts differ from the start."""
    from fuel.io.bundled import bundled_gguf

    tok = _tokenizer(str(bundled_gguf("smollm2")))
    body = tok.encode(TEXT * (1 + n_tokens // 30), add_bos=False)

    def messages(k: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"Session {tag}. " + tok.decode(body[:k])},
                {"role": "user", "content": "Continue the story."}]

    lo, hi = 0, len(body)  # the largest k whose prompt fits: prompt length grows with k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.encode_chat(messages(mid))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return messages(lo)


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(path: str) -> Any:
    from fuel.models.tokenizer import GGUFTokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = GGUFTokenizer.from_gguf(path)
    return _TOKENIZERS[path]


def request_body(engine: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy chat request that runs to max_tokens on `engine`."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if engine == "llama_cpp_python":
        body["min_tokens"] = max_tokens  # its stand-in for ignore_eos: EOS is masked until then
    else:
        body["ignore_eos"] = True
    return body


# ---- servers -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def missing(engine: str) -> str | None:
    """Why `engine` cannot run here (with the command that fixes it), or None."""
    if engine == "llama_server" and not os.access(LLAMA_SERVER, os.X_OK):
        return f"{LLAMA_SERVER} is not built: {BUILD_HINT}"
    probes = {"llama_cpp_python": ([sys.executable, "-c", "import llama_cpp.server.app"],
                                   f"{BUILD_HINT} (installs llama-cpp-python[server])"),
              "fuel": ([sys.executable, "-m", "fuel.cli", "serve", "--help"], "install Fuel with its `serve` extra")}
    if engine in probes:
        cmd, hint = probes[engine]
        probe = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), cwd=ROOT)
        if probe.returncode != 0:
            tail = (probe.stderr.strip().splitlines() or ["failed"])[-1]
            return f"{tail}: {hint}"
    return None


def server_command(engine: str, model_path: str, port: int, slots: int) -> list[str]:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if engine == "fuel":
        return [sys.executable, "-m", "fuel.cli", "serve", "--model", model_path, *host, "--context", str(SLOT_CONTEXT),
                "--log-level", "warning", "--slots", str(slots)]
    if engine == "llama_server":
        return [str(LLAMA_SERVER), "-m", model_path, *host, "-np", str(slots), "-t", str(THREADS), "-tb",
                str(THREADS), "-c", str(slots * SLOT_CONTEXT), "--cont-batching"]
    if engine == "llama_cpp_python":
        return [sys.executable, "-m", "llama_cpp.server", "--model", model_path, *host, "--n_threads", str(THREADS),
                "--n_threads_batch", str(THREADS), "--n_ctx", str(SLOT_CONTEXT), "--interrupt_requests", "False"]
    raise ValueError(f"bench_serve: unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def server_env() -> dict[str, str]:
    """The servers' environment: without this machine's OpenBLAS settings (as `make bench`) and without the
    passive OpenMP wait `fuel bench` sets for torch (it would put llama.cpp's threads to sleep)."""
    drop = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), b""
    except OSError:
        return 0, b""


class Server:
    """One engine's server as a subprocess on 127.0.0.1; `with` starts it, waits until it answers, stops it.
    Its output goes to a temporary log whose last lines explain a server that fails to start."""

    def __init__(self, engine: str, cmd: list[str], port: int, timeout_s: float) -> None:
        self.engine, self.cmd, self.port, self.timeout_s = engine, cmd, port, timeout_s
        self.base = f"http://127.0.0.1:{port}"
        self.log_fd, self.log_path = tempfile.mkstemp(prefix=f"bench-serve-{engine}-", suffix=".log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.model = ""

    def log_tail(self, n: int = 3) -> str:
        lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-n:]) or "no output"

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_fd, stderr=subprocess.STDOUT, env=server_env(), cwd=ROOT)
        ready = "/v1/models" if self.engine == "llama_cpp_python" else "/health"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.__exit__()
                raise RuntimeError(f"{self.engine} exited with {self.proc.returncode}: {tail}")
            if _get(self.base + ready)[0] == 200:
                status, raw = _get(self.base + "/v1/models")
                models = json.loads(raw).get("data", []) if status == 200 else []
                self.model = str(models[0]["id"]) if models else "default"
                return self
            time.sleep(0.25)
        tail = self.log_tail()
        self.__exit__()
        raise RuntimeError(f"{self.engine} did not answer {ready} within {self.timeout_s:.0f} s: {tail}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_fd >= 0:
            os.close(self.log_fd)
            os.unlink(self.log_path)
            self.log_fd = -1


def measure(engine: str, concurrency: int, sizes: Sizes, round_no: int, model_path: str) -> dict[str, Any]:
    """Start `engine` with `concurrency` slots, warm it up, run the load and summarise it; errors are results."""
    port = free_port()
    try:
        with Server(engine, server_command(engine, model_path, port, concurrency), port,
                    sizes.start_timeout_s) as srv:
            url = srv.base + "/v1/chat/completions"
            warm = [[request_body(engine, srv.model, prompt_messages(f"w{round_no}-{c}", sizes.prompt),
                                  sizes.warmup_tokens)] for c in range(concurrency)]
            asyncio.run(serve_load.run_load(url, warm))
            load = [[request_body(engine, srv.model, prompt_messages(f"{round_no}-{c}-{i}", sizes.prompt),
                                  sizes.output) for i in range(sizes.requests)] for c in range(concurrency)]
            timings, wall = asyncio.run(serve_load.run_load(url, load))
    except RuntimeError as e:
        return {"error": str(e)}
    return serve_load.summarise(timings, wall)


# ---- the report ---------------------------------------------------------------------------------------


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's rounds at one concurrency: each metric's median and spread (min, max) over the rounds
    that ran without errors; an error when none did."""
    good = [r for r in rounds if "error" not in r and not r.get("errors")]
    if not good:
        first = rounds[0] if rounds else {}
        return {"error": first.get("error") or first.get("first_error") or "no rounds", "rounds": rounds}
    out: dict[str, Any] = {"rounds": rounds, "median": {}, "spread": {}}
    for key in (*METRICS, "completion_tokens_per_request", "prompt_tokens_per_request", "tokens_per_chunk"):
        values = [r[key] for r in good if r.get(key) is not None]
        out["median"][key] = statistics.median(values) if values else None
        out["spread"][key] = [min(values), max(values)] if values else None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def summarise(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Fuel's ratios to each peer per concurrency (medians over medians) and the issue's targets (None where
    an engine is missing). Latency ratios are fuel/peer too: below 1 is better."""
    med = {e: {c: r.get("median", {}) for c, r in by_c.items()} for e, by_c in results.items()}
    fuel = med.get("fuel", {})
    ratios: dict[str, Any] = {}
    for peer in PEERS:
        for c, m in med.get(peer, {}).items():
            ratios.setdefault(peer, {})[c] = {k: _ratio(fuel.get(c, {}).get(k), m.get(k)) for k in METRICS}
    targets: dict[str, bool | None] = {}
    scaling = _ratio(fuel.get("4", {}).get("tokens_per_s"), fuel.get("1", {}).get("tokens_per_s"))
    targets["fuel tokens/s at C=4 >= 2.5x at C=1"] = None if scaling is None else scaling >= 2.5
    for c in ("4", "8"):
        r = ratios.get("llama_server", {}).get(c, {})
        tps = r.get("tokens_per_s")
        targets[f"C={c}: tokens/s >= 2x llama-server"] = None if tps is None else tps >= 2.0
        lat = [r.get(k) for k in METRICS[1:]]
        targets[f"C={c}: TTFT and ITL p50/p99 <= llama-server"] = (None if any(v is None for v in lat)
                                                                   else all(v <= 1.0 for v in lat if v is not None))
    return {"fuel_c4_over_c1": scaling, "fuel_over": ratios, "targets": targets}


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def print_table(results: dict[str, dict[str, dict[str, Any]]], summary: dict[str, Any]) -> None:
    print(f"{'engine':17s} {'C':>2s} {'tok/s':>14s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} "
          f"{'ITL p99':>8s}   (ms; medians over rounds, tokens/s with its min-max)")
    for engine, by_c in results.items():
        for c, r in by_c.items():
            if "error" in r:
                print(f"{engine:17s} {c:>2s} unavailable: {r['error']}")
                continue
            m, s = r["median"], r["spread"]["tokens_per_s"]
            spread = f"{_fmt(m['tokens_per_s'])} ({s[0]:.0f}-{s[1]:.0f})"
            print(f"{engine:17s} {c:>2s} {spread:>14s} {_fmt(m['ttft_p50_ms'], '.0f'):>9s} "
                  f"{_fmt(m['ttft_p99_ms'], '.0f'):>9s} {_fmt(m['itl_p50_ms']):>8s} {_fmt(m['itl_p99_ms']):>8s}")
    for peer, by_c in summary["fuel_over"].items():
        for c, r in by_c.items():
            print(f"fuel/{peer} C={c}: " + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in r.items()))
    print(", ".join(f"{k}: {'-' if v is None else 'met' if v else 'MISSED'}" for k, v in summary["targets"].items()))


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"fuel": "C0", "llama_server": "C1", "llama_cpp_python": "C7"}
    for engine, by_c in results.items():
        pts = [(int(c), r["median"]["tokens_per_s"]) for c, r in by_c.items() if "median" in r]
        if pts:
            axes[0].plot(*zip(*pts, strict=True), marker="o", label=engine, color=colors.get(engine))
    axes[0].set(title="aggregate output tokens/s", xlabel="concurrency")
    axes[0].legend(fontsize=8)
    for ax, (name, keys) in zip(axes[1:], (("TTFT ms", ("ttft_p50_ms", "ttft_p99_ms")),
                                           ("inter-token latency ms", ("itl_p50_ms", "itl_p99_ms"))), strict=True):
        labels, p50, p99, cols = [], [], [], []
        for engine, by_c in results.items():
            for c, r in by_c.items():
                if "median" in r:
                    labels.append(f"{engine}\nC={c}")
                    p50.append(r["median"][keys[0]] or 0.0)
                    p99.append(r["median"][keys[1]] or 0.0)
                    cols.append(colors.get(engine, "C7"))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], p50, width=0.4, color=cols, label="p50")
        ax.bar([x + 0.2 for x in xs], p99, width=0.4, color=cols, alpha=0.5, label="p99")
        ax.set_xticks(list(xs), labels, fontsize=6)
        ax.set_yscale("log")
        ax.set_title(f"{name} (p50 solid, p99 light)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(out_dir: str, sizes: Sizes | None = None, engines: tuple[str, ...] = ENGINES) -> int:
    from fuel.io.bundled import bundled_gguf

    sizes = sizes or Sizes()
    model_path = str(bundled_gguf("smollm2"))
    absent = {e: missing(e) for e in engines}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A terminated run stops its server on the way out (the `with` in measure) and keeps the rounds it ran.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {e: {str(c): [] for c in sizes.concurrency} for e in engines}
    try:
        for r in range(sizes.rounds):
            order = [e for e in (engines if r % 2 == 0 else engines[::-1]) if absent[e] is None]
            for c in sizes.concurrency:
                for engine in order:
                    print(f"{engine} at concurrency {c} (round {r + 1} of {sizes.rounds}) ...", flush=True)
                    runs[engine][str(c)].append(measure(engine, c, sizes, r, model_path))
                    (out / "serve-rounds.json").write_text(json.dumps(runs, indent=1))
    finally:
        signal.signal(signal.SIGTERM, previous)
    results = {e: {c: ({"error": why} if (why := absent[e]) else combine(rs)) for c, rs in by_c.items()}
               for e, by_c in runs.items()}
    summary = summarise(results)
    print_table(results, summary)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "threads": THREADS, "model": Path(model_path).name, "sizes": asdict(sizes),
            "commands": {e: server_command(e, "MODEL", 0, 1) for e in engines}}
    (out / "serve.json").write_text(json.dumps({"meta": meta, "results": results, "summary": summary}, indent=1))
    plot(results, out / "serve.png")
    print(f"wrote {out / 'serve.json'} and {out / 'serve.png'}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--rounds", type=int, default=Sizes.rounds)
    ap.add_argument("--requests", type=int, default=Sizes.requests, help="requests per client")
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(Sizes.concurrency))
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    a = ap.parse_args()
    s = Sizes(rounds=a.rounds, requests=a.requests, concurrency=tuple(a.concurrency))
    raise SystemExit(main(a.out, s, tuple(a.engines)))
