"""Offline throughput: pagedjax vs HF transformers on the same model, machine and workload.

A seeded synthetic workload with ShareGPT-like lognormal prompt and output lengths (EOS ignored,
so every system generates exactly the same number of tokens). Baselines: HF `generate` one
request at a time, and in padded static batches. pagedjax runs with its defaults (prefix caching
on), timed from LLM(...) and one small request: its startup is reported, and any compile it meets
counts. Writes throughput_<backend>_<accelerator>.json under --out.

    pagedjax bench throughput [--model DIR] [--backend jax|torch] [--num-requests 32]
                              [--max-input 256] [--max-output 128] [--max-num-seqs 32]
                              [--hf-batch-size 8 | --no-hf] [--dtype auto] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedjax.benchmarks.harness import (
    accelerator_tag,
    add_dtype_argument,
    add_model_arguments,
    add_out_argument,
    args_record,
    environment,
    model_dir,
    print_table,
    write_json,
)
from pagedjax.benchmarks.hf_baseline import hf_generate, load_hf


def synthetic_workload(num_requests: int, vocab_size: int, *, seed: int, max_input: int,
                       max_output: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; lognormal lengths like ShareGPT's."""
    rng = np.random.default_rng(seed)
    inputs = np.clip(rng.lognormal(4.0, 0.8, num_requests), 4, max_input).astype(int)
    outputs = np.clip(rng.lognormal(3.6, 0.7, num_requests), 4, max_output).astype(int)
    return [(rng.integers(1, vocab_size, n).tolist(), int(m)) for n, m in zip(inputs, outputs)]


def run_pagedjax(model: str, backend: str, workload, warmup, args
                 ) -> tuple[float, str, float]:
    """Seconds for the workload, timed from LLM(...) and one small request (no other warm-up),
    the dtype used, and the seconds LLM(...) took."""
    from pagedjax import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, backend=backend, dtype=args.dtype,
              max_model_len=args.max_input + args.max_output, max_num_seqs=args.max_num_seqs)
    startup = time.perf_counter() - start

    def run(items) -> float:
        prompts = [{"prompt_token_ids": ids} for ids, _ in items]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for _, m in items]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(warmup)  # one request: lazy initialisation, as a user's first one
    return run(workload), llm.engine.config.dtype, startup


def run_hf(model, workload, batch_size: int) -> float:
    """HF generate over the workload, batch_size requests at a time (left-padded)."""
    return sum(hf_generate(model, [ids for ids, _ in workload[i : i + batch_size]],
                           max(m for _, m in workload[i : i + batch_size]))
               for i in range(0, len(workload), batch_size))


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_arguments(parser)
    parser.add_argument("--backend", choices=("jax", "torch"), default="jax")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baselines")
    parser.add_argument("--seed", type=int, default=0)
    add_dtype_argument(parser)
    add_out_argument(parser)
    return parser


def main(args: argparse.Namespace) -> dict:
    from pagedjax.config import ModelConfig

    with model_dir(args) as model:
        vocab = ModelConfig.from_pretrained(model).vocab_size
        lengths = dict(max_input=args.max_input, max_output=args.max_output)
        workload = synthetic_workload(args.num_requests, vocab, seed=args.seed, **lengths)
        warmup = [(list(reversed(workload[0][0])), 4)]  # one request of other tokens
        num_in = sum(len(ids) for ids, _ in workload)
        num_out = sum(m for _, m in workload)

        seconds, dtype, startup = run_pagedjax(model, args.backend, workload, warmup, args)
        timings = {f"pagedjax ({args.backend}, {dtype})": seconds}
        if not args.no_hf:
            hf = load_hf(model, dtype)
            run_hf(hf, workload[:1], 1)  # warm-up (lazy initialisation, CUDA context)
            device = f"{hf.device.type}, {dtype}"
            timings[f"HF generate, batch 1 ({device})"] = run_hf(hf, workload, 1)
            timings[f"HF generate, padded batch {args.hf_batch_size} ({device})"] = run_hf(
                hf, workload, args.hf_batch_size)
    rows = [{"system": name, "seconds": t, "output tok/s": num_out / t,
             "total tok/s": (num_in + num_out) / t} for name, t in timings.items()]
    for row in rows:
        row["× pagedjax"] = rows[0]["output tok/s"] / row["output tok/s"]
    print(f"{args.num_requests} requests, {num_in} prompt + {num_out} output tokens, "
          f"model {model}; pagedjax's LLM(...) took {startup:.1f} s")
    print_table(rows, ["system", "seconds", "output tok/s", "total tok/s", "× pagedjax"])
    env = environment()
    payload = {"args": args_record(args), "model": model, "startup_s": startup,
               "num_prompt_tokens": num_in, "num_output_tokens": num_out, "results": rows,
               "environment": env}
    path = write_json(f"throughput_{args.backend}_{accelerator_tag(env)}.json", payload,
                      args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main(add_cli_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
