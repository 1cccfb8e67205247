"""The offline engine with its core in this process or in its own (LLM(multiprocess=...)): decode
ms per step at batch B, both engines alive, rounds taking turns.

In one process, each step's outputs (RequestOutputs, detokenization) take the engine loop's
time; with the core in its own process (vLLM V1's default) they are built while it steps. A
round at batch B: B fresh prompts of --context random tokens generate 1 token, then B others
generate 1 + --steps; the difference over --steps is one decode step (the prefills, each one
step of B x --context tokens, cancel).

    python benchmarks/probes/core_process.py [--model DIR] [--backend jax|torch]
        [--batch-sizes 1 16 64] [--context 512] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (  # noqa: E402
    accelerator_tag,
    add_dtype_argument,
    add_model_arguments,
    add_out_argument,
    args_record,
    environment,
    print_table,
    write_json,
)

MODES = {"in-process": False, "core process": True}


def decode_ms(llm, rng: np.random.Generator, batch: int, context: int, steps: int,
              vocab_size: int) -> float:
    """One round: ms per decode step at this batch (see the module docstring)."""
    from pagedjax import SamplingParams

    def timed(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.integers(1, vocab_size, context).tolist()}
                   for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return 1e3 * (timed(1 + steps) - timed(1)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--backend", choices=("jax", "torch"), default="jax")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="each engine's share of the device (two are alive)")
    add_dtype_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()

    from pagedjax import LLM
    from pagedjax.config import ModelConfig
    from pagedjax.model_loader.demo import demo_model_dirs

    args.model = args.model or demo_model_dirs()[0]
    vocab_size = ModelConfig.from_pretrained(args.model).vocab_size
    engines, startup = {}, {}
    for mode, multiprocess in MODES.items():
        start = time.perf_counter()
        engines[mode] = LLM(args.model, multiprocess=multiprocess, backend=args.backend,
                            dtype=args.dtype, max_model_len=args.context + args.steps + 8,
                            max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False,
                            max_num_batched_tokens=max(args.batch_sizes) * args.context,
                            gpu_memory_utilization=args.gpu_memory_utilization)
        startup[mode] = time.perf_counter() - start
        print(f"{mode}: startup {startup[mode]:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    for llm in engines.values():  # the decode and prefill shapes once, untimed
        decode_ms(llm, rng, max(args.batch_sizes), args.context, 4, vocab_size)

    rows = []
    for batch in args.batch_sizes:
        rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):  # taking turns: the host's drift hits both
            for mode, llm in engines.items():
                rounds[mode].append(decode_ms(llm, rng, batch, args.context, args.steps,
                                              vocab_size))
        medians = {mode: statistics.median(ms) for mode, ms in rounds.items()}
        rows.append({"backend": args.backend, "batch": batch,
                     **{f"{mode} ms": medians[mode] for mode in MODES},
                     "core process speed": medians["in-process"] / medians["core process"],
                     "rounds ms": rounds})
        print(f"batch {batch}: ms per decode step, " + "; ".join(
            f"{mode} {' '.join(f'{ms:.3f}' for ms in rounds[mode])}" for mode in MODES),
            flush=True)
    for llm in engines.values():
        llm.shutdown()

    env = environment()
    print(f"{args.backend}, {args.dtype}, context {args.context}, median of {args.rounds} "
          f"rounds of {args.steps} decode steps, on {env['accelerator']}")
    print_table(rows, ["backend", "batch", "in-process ms", "core process ms",
                       "core process speed"])
    path = write_json(f"core_process_{args.backend}_{accelerator_tag(env)}.json",
                      {"env": env, "args": args_record(args), "startup s": startup,
                       "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
