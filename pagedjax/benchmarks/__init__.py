"""The benchmarks users run, as vLLM's `vllm bench`: `pagedjax bench latency` (batch-1 TTFT and
decode ms/token), `pagedjax bench throughput` (offline, a ShareGPT-like workload) and
`pagedjax bench serve` (load a running OpenAI-compatible server), each beside its peer where it
has one, on the shared harness (`harness.py`: environment record, JSON, tables, turns).

The repository's own benchmarks (speculation, peers, kernels, the GPU suite, ...) live in its
`benchmarks/` folder and share this harness."""
