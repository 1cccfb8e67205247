"""Speculative decoding: fixed k vs adaptive k vs no speculation, per backend and batch size.

Every request decodes --max-tokens greedy tokens from a prompt cut from this Python's standard
library source. For each backend and batch size B: no speculation (k = 0), each fixed k
(`"adaptive": False`), and the adaptive policy (k chosen per step up to --adaptive-k) with one
LLM configuration for every B; the configurations take turns pass by pass, so that a drifting
host slows them alike. As a user meets them: timed from LLM(...) with no warm-up, every pass
counted (the mean; the adaptive policy's first steps and any compile included). Reports output
tokens/s, the speed-up over k = 0, the acceptance α, tokens per verification beside the i.i.d.
expectation (1 − α^(k+1)) / (1 − α), for adaptive runs the k chosen, and the compiles each LLM
met after startup. Writes spec_decode_*.json and a PNG plot to --out.

    python benchmarks/spec_decode.py [--target DIR --draft DIR] [--backends jax torch]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    accelerator_tag,
    add_out_argument,
    environment,
    print_table,
    write_json,
)

_SOURCES = ("argparse.py", "dataclasses.py", "functools.py", "json/decoder.py", "pathlib.py",
            "textwrap.py", "typing.py", "inspect.py")
_MIN_PROMPTS = 8  # small batches run this many prompts, b at a time: no one-prompt verdicts
_DELTAS = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
           "spec_decode_num_verifications")


def code_prompts(tokenizer, num: int, length: int = 64) -> list[list[int]]:
    """num prompts of `length` tokens cut at spread-out offsets of stdlib source files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    streams = [tokenizer.encode((root / f).read_text(encoding="utf-8")) for f in _SOURCES]
    prompts = []
    for i in range(num):
        ids = streams[i % len(streams)]
        start = (i // len(streams) * 997 + 131 * i) % max(1, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def timed_generate(llms: dict, groups: list[list[list[int]]], max_tokens: int,
                   repeats: int) -> dict[str, tuple[float, int]]:
    """name -> mean seconds and output tokens of greedy batches run one after another (one per
    group of prompts) on that LLM, over `repeats` rounds: every round counts, the first too. In
    a round every LLM runs one pass, in turns, so that a host whose speed drifts (a shared
    machine) slows them alike."""
    from pagedjax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seconds: dict[str, float] = dict.fromkeys(llms, 0.0)
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, llm in llms.items():
            start, tokens[name] = time.perf_counter(), 0
            for group in groups:
                outputs = llm.generate([{"prompt_token_ids": p} for p in group], params,
                                       use_tqdm=False)
                tokens[name] += sum(len(o.outputs[0].token_ids) for o in outputs)
            seconds[name] += time.perf_counter() - start
    return {name: (s / repeats, tokens[name]) for name, s in seconds.items()}


def make_llm(model: str, backend: str, args, draft: str | None = None, k: int = 0,
             adaptive: bool = False, memory_share: float = 0.9):
    """memory_share: the gpu_memory_utilization this engine is built with. An engine's KV
    pool takes that fraction of the device less what is in use, the engines built before it
    in this process included, so the i-th of n engines gets 0.9 * (i + 1) / n (on an H200 the
    first engine of the grid took the whole device and the second had no room for its pool)."""
    from pagedjax import LLM

    spec = ({"model": draft, "num_speculative_tokens": k, "adaptive": adaptive} if k else None)
    return LLM(model, backend=backend, max_model_len=args.max_model_len,
               max_num_seqs=max(args.batch_sizes), speculative_config=spec,
               gpu_memory_utilization=memory_share)


def run_backend(backend: str, args) -> list[dict]:
    configs = [("k=0", 0, False), *((f"k={k}", k, False) for k in args.ks),
               (f"adaptive≤{args.adaptive_k}", args.adaptive_k, True)]
    llms = {mode: make_llm(args.target, backend, args, args.draft, k, adaptive,
                           memory_share=0.9 * (i + 1) / len(configs))
            for i, (mode, k, adaptive) in enumerate(configs)}
    prompts = code_prompts(llms["k=0"].get_tokenizer(), max(*args.batch_sizes, _MIN_PROMPTS))
    rows = []
    for b in args.batch_sizes:
        pool = prompts[: max(b, _MIN_PROMPTS)]
        groups = [pool[i : i + b] for i in range(0, len(pool), b)]
        before = {mode: llm.get_metrics() for mode, llm in llms.items()}
        results = timed_generate(llms, groups, args.max_tokens, args.repeats)
        for mode, k, _ in configs:
            rows.append(_row(backend, b, mode, k, *results[mode], before[mode],
                             llms[mode].get_metrics()))
    for llm in llms.values():
        llm.shutdown()
    return rows


def _row(backend: str, b: int, mode: str, k: int, seconds: float, tokens: int, before: dict,
         after: dict) -> dict:
    row = {"backend": backend, "batch": b, "mode": mode, "output tok/s": tokens / seconds,
           "ms/token": 1e3 * seconds * b / tokens, "seconds": seconds,
           "compiles after startup": after["num_compiles_after_startup"]}
    if not k:
        return row
    # every pass decodes the same tokens: acceptance over all of them
    delta = {m: after[m] - before.get(m, 0) for m in _DELTAS}
    alpha = delta["spec_decode_num_accepted_tokens"] / max(delta["spec_decode_num_draft_tokens"], 1)
    steps_per_k = [n - m for n, m in zip(after["spec_decode_steps_per_k"],
                                          before.get("spec_decode_steps_per_k", [0] * (k + 1)))]
    row.update({
        "alpha": alpha,
        "tokens/verify": 1 + delta["spec_decode_num_accepted_tokens"]
        / max(delta["spec_decode_num_verifications"], 1),
        "expected tokens/verify": (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0,
        "acceptance per position": after["spec_decode_acceptance_per_position"],
        # over every pass (the policy learns in the first ones)
        "mean k": sum(kk * n for kk, n in enumerate(steps_per_k)) / max(sum(steps_per_k), 1),
        "steps per k": steps_per_k,
    })
    return row


def add_speedups(rows: list[dict]) -> None:
    base = {(r["backend"], r["batch"]): r["output tok/s"] for r in rows if r["mode"] == "k=0"}
    for r in rows:
        r["speedup"] = r["output tok/s"] / base[r["backend"], r["batch"]]


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
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["batch"], r["speedup"]) for r in rows
                         if r["backend"] == backend and r["mode"] == mode)
            style = dict(lw=2.5, color="black") if mode.startswith("adaptive") else {}
            ax.plot(*zip(*pts), marker="o", label=mode, **style)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{backend}: speculative decoding", xlabel="batch size",
               ylabel="× output tok/s of k = 0")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    from pagedjax.model_loader.demo import demo_model_dirs

    target, draft = demo_model_dirs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=target)
    parser.add_argument("--draft", default=draft)
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--adaptive-k", type=int, default=4, help="the adaptive policy's max k")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed passes per case; every one counts (the mean)")
    add_out_argument(parser)
    args = parser.parse_args()

    rows = [r for backend in args.backends for r in run_backend(backend, args)]
    add_speedups(rows)
    print_table(rows, ["backend", "batch", "mode", "output tok/s", "ms/token", "speedup",
                       "alpha", "tokens/verify", "expected tokens/verify", "mean k",
                       "compiles after startup"])
    env = environment()
    tag = "_".join([*args.backends, accelerator_tag(env)])
    path = write_json(f"spec_decode_{tag}.json", {"args": vars(args), "results": rows,
                                                  "environment": env}, args.out)
    print(f"wrote {path}")
    plot(rows, Path(args.out) / f"spec_decode_{tag}.png")


if __name__ == "__main__":
    main()
