"""How kernels run: one pool of spinning workers, the thread policy, and the captured replay of `fl.jit`.

- `pool`: the spinning worker pool that runs a job's parts (`fn(part, parts, argv)`), and the compiled
  loop that posts a replayed program's jobs;
- `jobs`: a job (task, argument record, one-core cost) as every caller posts it;
- `threads`: the thread count and the BLAS policy;
- `atomics`: atomics, pointers and calls by address for jitted code;
- `jit`, `arena`, `replay`, `buffers`: capture and replay of a traced step.
"""
