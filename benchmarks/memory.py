"""KV memory as PagedAttention promises it, on a seeded ShareGPT-like workload.

- waste: allocated − used KV slots over allocated (time-averaged over steps, and at the step
  of peak allocation), beside a contiguous max-length reservation per request (a static cache
  of max_model_len, as HF's StaticCache) and an exact-length one (prompt + the output it will
  produce, known in advance);
- sharing: KV blocks held with n = 2/4/6 samples and beam width 2/4/6, sharing vs the same
  engine with forks copying every block (CopyingBlockManager);
- prefix caching: hit rate and prefill tokens saved on a shared system prompt and on 4-turn chats;
- beam search throughput against HF `generate(num_beams=4)` on the same model and prompts.

    python benchmarks/memory.py [--backend torch|jax] [--model DIR] [--quick] [--skip-hf]

Writes memory_<accelerator>.json and memory_<accelerator>.png under --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    accelerator_tag,
    add_out_argument,
    environment,
    print_table,
    write_json,
)

from pagedjax.benchmarks.hf_baseline import load_hf  # noqa: E402

# ShareGPT as the PagedAttention paper measures it: 161 prompt and 338 output tokens on average.
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 161, 338
PAPER_SAVINGS = {"parallel sampling": (0.162, 0.305), "beam search": (0.443, 0.663)}


def sharegpt_lengths(rng: np.random.Generator, num: int, *, max_input: int,
                     max_output: int, scale: float = 1.0) -> list[tuple[int, int]]:
    """(prompt, output) lengths: lognormal with ShareGPT's means (times scale), clipped."""
    def draw(mean: float, sigma: float, high: int) -> np.ndarray:
        mu = np.log(mean * scale) - sigma**2 / 2
        return np.clip(rng.lognormal(mu, sigma, num), 4, high).astype(int)

    return list(zip(draw(SHAREGPT_MEAN_INPUT, 0.8, max_input).tolist(),
                    draw(SHAREGPT_MEAN_OUTPUT, 0.7, max_output).tolist()))


def make_llm(args, **kwargs):
    from pagedjax import LLM

    options = dict(backend=args.backend, dtype="float32", max_model_len=args.max_model_len,
                   num_gpu_blocks_override=args.num_blocks, enable_prefix_caching=False)
    return LLM(args.model, **{**options, **kwargs})


def share_nothing(llm) -> None:
    """The same engine with forks disabled: every fork copies its parent's blocks."""
    from pagedjax.core.block_manager import CopyingBlockManager

    engine, core = llm.engine, llm.engine.engine_core
    bm = core.block_manager
    copying = CopyingBlockManager(bm.num_blocks, bm.block_size, bm.enable_prefix_caching)
    engine.block_manager = core.block_manager = core.scheduler.block_manager = copying


def used_blocks(llm) -> int:
    bm = llm.engine.block_manager
    return bm.num_blocks - bm.num_free_blocks


def run_steps(llm, on_step=None, arrivals=()) -> dict:
    """Step the engine to the end; after each step call on_step(); before step i add the
    requests arrivals[i] (request id, prompt, params). Returns the finished outputs by id."""
    engine, outputs, arrivals, i = llm.engine, {}, list(arrivals), 0
    while engine.has_unfinished_requests() or i < len(arrivals):
        for request in arrivals[i] if i < len(arrivals) else ():
            engine.add_request(*request)
        i += 1
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        if on_step is not None:
            on_step()
    return outputs


# ---- 1. waste --------------------------------------------------------------------------------


def kv_waste(args, rng: np.random.Generator) -> dict:
    from pagedjax import SamplingParams

    llm = make_llm(args)
    lengths = sharegpt_lengths(rng, args.num_requests, max_input=args.max_model_len // 2,
                               max_output=args.max_model_len // 2, scale=args.scale)
    final_len = {}
    for i, (num_in, num_out) in enumerate(lengths):
        prompt = rng.integers(1, llm.engine.model_config.vocab_size, num_in).tolist()
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=num_out,
                                              ignore_eos=True))
        final_len[f"r{i}"] = num_in + num_out
    block_size, scheduler = llm.engine.config.block_size, llm.engine.scheduler
    trace = []

    def on_step() -> None:
        running = scheduler.running
        trace.append({
            "used": sum(s.num_computed_tokens for s in running),  # KV slots written
            "paged": used_blocks(llm) * block_size,
            "contiguous_max": len(running) * args.max_model_len,
            "contiguous_exact": sum(final_len[s.request_id] for s in running)})

    run_steps(llm, on_step)
    assert llm.get_metrics()["num_preemptions_total"] == 0, "give the pool more blocks"
    used = np.array([t["used"] for t in trace], float)
    systems = {}
    for name in ("paged", "contiguous_max", "contiguous_exact"):
        alloc = np.array([t[name] for t in trace], float)
        peak = int(np.argmax(alloc))
        systems[name] = {"waste_time_avg": float((alloc - used).sum() / alloc.sum()),
                         "waste_at_peak": float((alloc[peak] - used[peak]) / alloc[peak]),
                         "peak_slots": int(alloc[peak])}
    return {"num_requests": len(lengths), "block_size": block_size,
            "mean_prompt": float(np.mean([a for a, _ in lengths])),
            "mean_output": float(np.mean([b for _, b in lengths])),
            "systems": systems, "trace": trace}


# ---- 2. sharing ------------------------------------------------------------------------------


def sharing(args, rng: np.random.Generator) -> list[dict]:
    """Blocks held per step with forks sharing vs copying, for each n and beam width."""
    from pagedjax import BeamSearchParams, SamplingParams

    lengths = sharegpt_lengths(rng, args.num_shared_prompts, max_input=args.max_model_len // 2,
                               max_output=args.max_model_len // 2, scale=args.scale)
    vocab = make_llm(args).engine.model_config.vocab_size
    prompts = [rng.integers(1, vocab, n).tolist() for n, _ in lengths]
    rows = []
    for kind, width in [("parallel sampling", n) for n in (2, 4, 6)] + [
            ("beam search", w) for w in (2, 4, 6)]:
        def params(i: int, num_out: int, kind=kind, width=width):
            if kind == "beam search":
                return BeamSearchParams(width, num_out, ignore_eos=True)
            return SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=num_out,
                                  ignore_eos=True)

        traces, tokens = {}, {}
        for mode in ("shared", "copied"):
            llm = make_llm(args)
            if mode == "copied":
                share_nothing(llm)
            trace = []
            arrivals = [[(f"r{i}", {"prompt_token_ids": p}, params(i, num_out))
                         for i, (p, (_, num_out)) in enumerate(zip(prompts, lengths))]]
            outputs = run_steps(llm, lambda llm=llm, trace=trace: trace.append(used_blocks(llm)),
                                arrivals)
            assert llm.get_metrics()["num_preemptions_total"] == 0, "give the pool more blocks"
            traces[mode] = np.array(trace, float)
            tokens[mode] = {k: [c.token_ids for c in o.outputs] for k, o in outputs.items()}
        assert tokens["shared"] == tokens["copied"], "sharing must not change the tokens"
        shared, copied = traces["shared"], traces["copied"]
        assert len(shared) == len(copied)  # the same schedule, step for step
        rows.append({"kind": kind, "width": width,
                     "saving_time_avg": float(1 - shared.sum() / copied.sum()),
                     "saving_at_peak": float(1 - shared.max() / copied.max()),
                     "peak_blocks_shared": int(shared.max()),
                     "peak_blocks_copied": int(copied.max())})
        print(f"  {kind} {width}: saving {rows[-1]['saving_time_avg']:.1%}")
    return rows


# ---- 3. prefix caching -------------------------------------------------------------------------


def prefix_caching(args, rng: np.random.Generator) -> dict:
    from pagedjax import SamplingParams

    llm = make_llm(args, enable_prefix_caching=True)
    vocab = llm.engine.model_config.vocab_size
    system = rng.integers(1, vocab, args.system_prompt_len).tolist()
    lengths = sharegpt_lengths(rng, args.num_requests, max_input=256, max_output=64,
                               scale=args.scale)
    # One request arrives per step (a stream, not a burst: a block is cached once computed).
    arrivals = [[(f"s{i}", {"prompt_token_ids": system + rng.integers(1, vocab, n).tolist()},
                  SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))]
                for i, (n, m) in enumerate(lengths)]
    outputs = run_steps(llm, arrivals=arrivals)
    results = {"shared system prompt": _cache_stats(llm, outputs.values())}
    results["shared system prompt"]["system_prompt_len"] = args.system_prompt_len

    llm = make_llm(args, enable_prefix_caching=True)
    histories = [[] for _ in range(args.num_chats)]
    per_turn = []
    for turn in range(4):
        arrivals = []
        for c, history in enumerate(histories):
            user = rng.integers(1, vocab, int(rng.integers(20, 80 * args.scale + 21))).tolist()
            history += user
            params = SamplingParams(temperature=0.0, ignore_eos=True,
                                    max_tokens=int(rng.integers(16, 100 * args.scale + 17)))
            arrivals.append([(f"c{c}-t{turn}", {"prompt_token_ids": list(history)}, params)])
        outputs = run_steps(llm, arrivals=arrivals)
        for c, history in enumerate(histories):
            history += outputs[f"c{c}-t{turn}"].outputs[0].token_ids
        per_turn.append(_cache_stats(None, outputs.values()))
    prompt = sum(t["prompt_tokens"] for t in per_turn)
    cached = sum(t["cached_tokens"] for t in per_turn)
    results["4-turn chats"] = {
        **_cache_stats(llm, []), "prompt_tokens": prompt, "cached_tokens": cached,
        "prefill_saved": cached / prompt, "per_turn": per_turn, "num_chats": args.num_chats}
    return results


def _cache_stats(llm, outputs) -> dict:
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    stats = {"prompt_tokens": prompt, "cached_tokens": cached,
             "prefill_saved": cached / prompt if prompt else None}
    if llm is not None:
        metrics = llm.get_metrics()
        stats["hit_rate"] = metrics["prefix_cache_hits"] / metrics["prefix_cache_queries"]
    return stats


# ---- 4. beam search throughput ---------------------------------------------------------------


def beam_throughput(args, rng: np.random.Generator) -> dict:
    from pagedjax import BeamSearchParams

    width, num_tokens = 4, args.beam_tokens
    llm = make_llm(args)
    vocab = llm.engine.model_config.vocab_size
    lengths = sharegpt_lengths(rng, args.num_beam_prompts, max_input=256, max_output=1,
                               scale=args.scale)
    prompts = [rng.integers(1, vocab, n).tolist() for n, _ in lengths]
    params = BeamSearchParams(width, num_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def ours() -> float:
        start = time.perf_counter()
        llm.beam_search(inputs, params)
        return time.perf_counter() - start

    ours()  # warm-up: the same shapes (compiles on jax)
    result = {"beam_width": width, "num_prompts": len(prompts), "num_tokens": num_tokens,
              "mean_prompt": float(np.mean(lengths, axis=0)[0])}
    hf = None if args.skip_hf else load_hf(args.model, "float32")
    timings: dict[str, list[float]] = {"pagedjax": [], "hf": []}
    for _ in range(args.repeats):  # alternate, so that both see the same machine load
        timings["pagedjax"].append(ours())
        if hf is not None:
            timings["hf"].append(_hf_beam_search(hf, prompts, width, num_tokens))
    beam_tokens = width * len(prompts) * num_tokens
    for name, seconds in timings.items():
        if seconds:
            result[name] = {"seconds": statistics.median(seconds), "runs": seconds,
                            "beam_tokens_per_s": beam_tokens / statistics.median(seconds)}
    if hf is not None:
        result["speedup"] = result["hf"]["seconds"] / result["pagedjax"]["seconds"]
    return result


def _hf_beam_search(model, prompts: list[list[int]], width: int, num_tokens: int) -> float:
    """Seconds for one HF generate(num_beams=width) over the left-padded batch of prompts."""
    import torch

    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, num_beams=width, do_sample=False,
                       max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                       early_stopping=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


# ---- plots and main --------------------------------------------------------------------------


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    _plot_waste(axes[0], results["waste"])
    _plot_sharing(axes[1], results["sharing"])
    _plot_prefix(axes[2], results["prefix_caching"])
    _plot_beam(axes[3], results["beam_throughput"])
    fig.suptitle(f"pagedjax KV memory ({results['environment']['accelerator']}, "
                 f"{results['args']['backend']} backend, commit "
                 f"{results['environment']['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_waste(ax, waste: dict) -> None:
    trace = waste["trace"]
    steps = np.arange(len(trace))
    for name, style in (("contiguous_max", ":"), ("contiguous_exact", "--"), ("paged", "-")):
        pct = waste["systems"][name]["waste_time_avg"]
        ax.plot(steps, [t[name] for t in trace], style, label=f"{name} ({pct:.1%} waste)")
    ax.plot(steps, [t["used"] for t in trace], "k-", lw=0.8, label="used (KV written)")
    ax.set(title="KV slots allocated vs used", xlabel="engine step", ylabel="slots",
           yscale="log")
    ax.legend(fontsize=8)


def _plot_sharing(ax, rows: list[dict]) -> None:
    labels = [f"{'n' if r['kind'] == 'parallel sampling' else 'beam'}={r['width']}"
              for r in rows]
    ax.bar(labels, [100 * r["saving_time_avg"] for r in rows],
           color=["C0" if r["kind"] == "parallel sampling" else "C1" for r in rows])
    for i, (low, high) in enumerate(PAPER_SAVINGS.values()):
        ax.fill_between([3 * i - 0.4, 3 * i + 2.4], 100 * low, 100 * high, color="grey",
                        alpha=0.25, label="paper (ShareGPT)" if i == 0 else None)
    ax.set(title="memory saved by sharing blocks (time-averaged)", ylabel="%")
    ax.legend(fontsize=8)


def _plot_prefix(ax, prefix: dict) -> None:
    names = list(prefix)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [100 * prefix[n]["hit_rate"] for n in names], 0.4, label="hit rate")
    ax.bar(x + 0.2, [100 * prefix[n]["prefill_saved"] for n in names], 0.4,
           label="prefill tokens saved")
    ax.set_xticks(x, names)
    ax.set(title="prefix caching", ylabel="%")
    ax.legend(fontsize=8)


def _plot_beam(ax, beam: dict) -> None:
    names = [n for n in ("pagedjax", "hf") if n in beam]
    ax.bar(["pagedjax" if n == "pagedjax" else "HF generate" for n in names],
           [beam[n]["beam_tokens_per_s"] for n in names], color=["C0", "C3"][: len(names)])
    speedup = f", {beam['speedup']:.1f}x" if "speedup" in beam else ""
    ax.set(title=f"beam search, width {beam['beam_width']}, {beam['num_prompts']} prompts"
                 f"{speedup}", ylabel="beam tokens / s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint dir (default: the demo target)")
    parser.add_argument("--backend", choices=("jax", "torch"), default="torch")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--num-shared-prompts", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=300)
    parser.add_argument("--num-chats", type=int, default=16)
    parser.add_argument("--num-beam-prompts", type=int, default=16)
    parser.add_argument("--beam-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="length scale (1: ShareGPT)")
    parser.add_argument("--skip-hf", action="store_true", help="no HF baseline")
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.num_shared_prompts, args.num_chats = 8, 2, 4
        args.num_beam_prompts, args.beam_tokens, args.repeats, args.scale = 4, 8, 1, 0.1
    from pagedjax.model_loader.demo import demo_model_dirs

    args.model = args.model or demo_model_dirs()[0]
    rng = np.random.default_rng(args.seed)
    results = {"args": vars(args), "environment": environment()}
    print("KV waste ...")
    results["waste"] = kv_waste(args, rng)
    print_table([{"system": k, **v} for k, v in results["waste"]["systems"].items()],
                ["system", "waste_time_avg", "waste_at_peak", "peak_slots"])
    print("sharing ...")
    results["sharing"] = sharing(args, rng)
    print("prefix caching ...")
    results["prefix_caching"] = prefix_caching(args, rng)
    print({k: {m: v.get(m) for m in ("hit_rate", "prefill_saved")}
           for k, v in results["prefix_caching"].items()})
    print("beam search throughput ...")
    results["beam_throughput"] = beam_throughput(args, rng)
    print(results["beam_throughput"])
    name = f"memory_{accelerator_tag(results['environment'])}"
    path = write_json(f"{name}.json", results, args.out)
    print(f"wrote {path} and {plot(results, Path(args.out) / f'{name}.png')}")


if __name__ == "__main__":
    main()
