"""Speculative decoding: acceptance, accepted length and speed-up against the theory.

For each backend, batch size B and number of drafts k (k = 0: no speculation), every request
decodes --max-tokens greedy tokens from a code prompt. Reports the acceptance rate α, the mean
number of tokens per verification (beside the expectation (1 − α^(k+1)) / (1 − α)), output
tokens/s, per-token latency, and the measured speed-up beside E / (k·c + 1), where c is the
draft's decode step time over the target's. Writes benchmarks/results/spec_decode_*.json + PNG.

    python benchmarks/spec_decode.py [--target DIR --draft DIR] [--backends jax torch]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402

PROMPTS = ["def ", "import os\n", "class ", "    def __init__(self", "for i in range(",
           "if __name__ == ", "from collections import ", "return "]


def timed_generate(llm, batch_size: int, max_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens of one greedy batch (after a warm-up of the same shapes)."""
    from pagedjax import SamplingParams

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles / captures happen here
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def make_llm(model: str, backend: str, draft: str | None, k: int, args):
    from pagedjax import LLM

    spec = {"model": draft, "num_speculative_tokens": k} if k else None
    return LLM(model, backend=backend, max_model_len=args.max_model_len,
               max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False,
               speculative_config=spec)


def run_backend(backend: str, args) -> list[dict]:
    rows = []
    step_time = {}  # (model, B) -> seconds per decode step without speculation
    for name, model in (("target", args.target), ("draft", args.draft)):
        llm = make_llm(model, backend, None, 0, args)
        for b in args.batch_sizes:
            seconds, _ = timed_generate(llm, b, args.max_tokens)
            step_time[name, b] = seconds / args.max_tokens
    for k in [0, *args.ks]:
        llm = make_llm(args.target, backend, args.draft, k, args)
        for b in args.batch_sizes:
            before = dict(llm.get_metrics())
            seconds, tokens = timed_generate(llm, b, args.max_tokens)
            rows.append(_row(backend, b, k, seconds, tokens, before, llm.get_metrics(),
                             step_time))
    return rows


def _row(backend: str, b: int, k: int, seconds: float, tokens: int, before: dict, after: dict,
         step_time: dict) -> dict:
    row = {"backend": backend, "batch": b, "k": k, "output tok/s": tokens / seconds,
           "ms/token": 1e3 * seconds * b / tokens, "seconds": seconds}
    if k == 0:
        return row
    # The first generate() was the warm-up: metrics of the timed run are the difference / 2.
    delta = {m: (after[m] - before.get(m, 0)) / 2 for m in (
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_verifications")}
    alpha = delta["spec_decode_num_accepted_tokens"] / max(delta["spec_decode_num_draft_tokens"], 1)
    c = step_time["draft", b] / step_time["target", b]
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
    row.update({
        "alpha": alpha, "c": c,
        "tokens/verify": 1 + delta["spec_decode_num_accepted_tokens"]
        / max(delta["spec_decode_num_verifications"], 1),
        "expected tokens/verify": expected,
        "expected speedup": expected / (k * c + 1),
    })
    return row


def add_speedups(rows: list[dict]) -> None:
    base = {(r["backend"], r["batch"]): r["output tok/s"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup"] = r["output tok/s"] / base[r["backend"], r["batch"]]


def best_k(rows: list[dict]) -> list[dict]:
    """Per backend and batch size, the k (0 = no speculation) with the most output tokens/s."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["backend"], r["batch"])
        if key not in best or r["output tok/s"] > best[key]["output tok/s"]:
            best[key] = r
    return [{"backend": b, "batch": n, "best k": r["k"], "speedup": r["speedup"]}
            for (b, n), r in sorted(best.items())]


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        for b in sorted({r["batch"] for r in rows}):
            pts = sorted((r["k"], r["speedup"]) for r in rows
                         if r["backend"] == backend and r["batch"] == b)
            ax.plot(*zip(*pts), marker="o", label=f"batch {b}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(title=f"{backend}: speculative speed-up", xlabel="k", ylabel="× no speculation")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    from pagedjax.demo import demo_model_dirs

    target, draft = demo_model_dirs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=target)
    parser.add_argument("--draft", default=draft)
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()

    rows = [r for backend in args.backends for r in run_backend(backend, args)]
    add_speedups(rows)
    print_table(rows, ["backend", "batch", "k", "output tok/s", "ms/token", "speedup", "alpha",
                       "tokens/verify", "expected tokens/verify", "c", "expected speedup"])
    print_table(best_k(rows), ["backend", "batch", "best k", "speedup"])
    env = environment()
    tag = env["accelerator"].replace(" ", "_")
    write_json(f"spec_decode_{tag}.json", {"args": vars(args), "results": rows,
                                           "best_k": best_k(rows), "environment": env})
    plot(rows, RESULTS_DIR / f"spec_decode_{tag}.png")


if __name__ == "__main__":
    main()
