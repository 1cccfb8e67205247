"""Single-request latency: time to first token and ms per output token at batch 1, pagedjax beside
HF transformers' `generate` on the same model, device and dtype, with a breakdown of where each
engine step's time goes (schedule, prepare, execute on the device, update, output processing).

As a user meets it: the engine with its defaults (prefix caching on), timed from the moment
`LLM(...)` returns (its startup is reported beside), after one untimed request of other lengths
(HF's too: its lazy initialisation) and no other warm-up. Five prompt lengths of 24-90 tokens,
greedy, EOS ignored, fresh random tokens in every run (no prefix-cache hit flatters TTFT).
TTFT is the time of a 1-token request; decode ms/token is (t(N tokens) - t(1 token)) / (N - 1),
summed over the prompts. The systems take turns prompt by prompt, --repeats times, and every
run counts (the mean), the first included.

    pagedjax bench latency [--model DIR | --random-llama] [--backend jax|torch]
                           [--max-tokens 64] [--dtype auto] [--repeats 3] [--no-hf] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedjax.benchmarks.harness import (
    accelerator_tag,
    add_async_scheduling_argument,
    add_dtype_argument,
    add_model_arguments,
    add_out_argument,
    args_record,
    environment,
    model_dir,
    model_name,
    print_table,
    step_phases_ms,
    write_json,
)
from pagedjax.benchmarks.hf_baseline import hf_generate, load_hf

PROMPT_LENGTHS = (24, 40, 57, 73, 90)


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def pagedjax_runner(args) -> tuple[Callable[[list[int], int], float], Any, float]:
    """(run(prompt, num_tokens) -> seconds, the LLM, the seconds LLM(...) took)."""
    from pagedjax import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, backend=args.backend, dtype=args.dtype,
              max_model_len=max(PROMPT_LENGTHS) + args.max_tokens + 16,
              async_scheduling=args.async_scheduling)
    startup = time.perf_counter() - start

    def run(prompt: list[int], num_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return time.perf_counter() - start

    return run, llm, startup


def hf_runner(args, dtype: str) -> Callable[[list[int], int], float]:
    model = load_hf(args.model, dtype)
    return lambda prompt, num_tokens: hf_generate(model, [prompt], num_tokens)


def measure(runs: dict[str, Callable[[list[int], int], float]], vocab_size: int,
            num_tokens: int, repeats: int) -> dict[str, dict]:
    """Each system's row, after one untimed request each. The systems take turns, prompt by
    prompt, `repeats` times, on the same fresh prompts; a prompt's time is its mean."""
    for run in runs.values():  # one request of its own: lazy initialisation, nothing else
        run(make_prompts(vocab_size, seed=10_000)[0][:7], 3)
    total = {name: np.zeros(2) for name in runs}
    for r in range(repeats):
        first_prompts = make_prompts(vocab_size, seed=2 * r)  # the 1-token runs
        full_prompts = make_prompts(vocab_size, seed=2 * r + 1)  # the N-token runs
        for first, full in zip(first_prompts, full_prompts):
            for name, run in runs.items():
                total[name] += (run(first, 1), run(full, num_tokens))
    return {name: _row(name, *(t / repeats), num_tokens, len(PROMPT_LENGTHS))
            for name, t in total.items()}


def step_breakdown(llm, prompts: list[list[int]], num_tokens: int) -> dict[str, float]:
    """ms per engine step in each phase, over one more pass of the prompts."""
    from pagedjax import SamplingParams

    timings = llm.engine.step_timings
    timings.__init__()
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for prompt in prompts:
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return step_phases_ms(timings)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _row(system: str, first: float, full: float, num_tokens: int, num_prompts: int) -> dict:
    return {"system": system, "TTFT ms": 1e3 * first / num_prompts,
            "decode ms/token": 1e3 * (full - first) / (num_prompts * (num_tokens - 1)),
            "end-to-end ms/token": 1e3 * full / (num_prompts * num_tokens)}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_arguments(parser, random_llama=True)
    parser.add_argument("--backend", choices=("jax", "torch"), default="jax")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_dtype_argument(parser)
    add_async_scheduling_argument(parser)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per prompt and system; each prompt's mean counts")
    add_out_argument(parser)
    return parser


def main(args: argparse.Namespace) -> dict:
    if args.max_tokens < 2:
        raise ValueError("--max-tokens must be >= 2 (decode time is t(N) - t(1))")
    from pagedjax.config import ModelConfig

    with model_dir(args):
        model_config = ModelConfig.from_pretrained(args.model)
        prompts = make_prompts(model_config.vocab_size)
        run, llm, startup = pagedjax_runner(args)
        name = f"pagedjax ({args.backend}, {llm.engine.config.dtype})"
        runs = {name: run}
        if not args.no_hf:
            dtype = llm.engine.config.dtype
            runs[f"HF generate ({'cuda' if _has_cuda() else 'cpu'}, {dtype})"] = hf_runner(
                args, dtype)
        rows = list(measure(runs, model_config.vocab_size, args.max_tokens,
                            args.repeats).values())
        rows[0]["startup s"] = startup
        breakdown = step_breakdown(llm, prompts, args.max_tokens)
        for r in rows:
            r["speed-up vs HF"] = rows[-1]["decode ms/token"] / r["decode ms/token"]
    print(f"batch 1, prompts of {PROMPT_LENGTHS} tokens, {args.max_tokens} greedy tokens each, "
          f"mean of {args.repeats}; pagedjax timed from LLM(...) and one request")
    print_table(rows, ["system", "startup s", "TTFT ms", "decode ms/token",
                       "end-to-end ms/token", "speed-up vs HF"])
    print("per engine step (ms):", {k: round(v, 3) for k, v in breakdown.items()})
    env = environment()
    payload = {"args": args_record(args), "prompt_lengths": PROMPT_LENGTHS, "results": rows,
               "compiles_after_startup": llm.get_metrics()["num_compiles_after_startup"],
               "repeats": args.repeats, "step_breakdown_ms": breakdown, "environment": env}
    path = write_json(f"latency_{args.backend}_{model_name(args)}_{accelerator_tag(env)}"
                      f"{'' if args.async_scheduling else '_sync'}.json", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main(add_cli_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
