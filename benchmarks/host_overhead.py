"""Host work per engine step: what the engine's Python costs, phase by phase, at each batch size.

Three runners, taking turns round by round:
- "host only": the fixed-token runner (pagedjax/core/fixed_token_runner.py). It computes no
  model: each row gets a fixed token, so a step's time is the engine's host work alone;
- the demo target on the jax and on the torch backend: the same phases beside a real step.

For each runner and batch size B: B requests of --context random prompt tokens, EOS ignored,
added as LLM.generate adds them (one output each at the end; --output-kind delta: an output
every step, as the server streams), stepped until every one decodes; then --steps engine steps
are timed. Reported per phase (schedule, prepare, launch, update, output, detokenize; execute:
waiting for the device step) in µs per step and µs per sequence, their mean over the timed
steps, and the host total: every phase but launch and execute (on a CPU the launch of a real
runner computes the step).

    python benchmarks/host_overhead.py [--runners host-only jax torch]
        [--batch-sizes 1 16 64 256 512] [--context 128] [--steps 32] [--rounds 3]
        [--output-kind final|delta] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    WARMUP_STEPS,
    accelerator_tag,
    add_out_argument,
    add_output_kind_argument,
    args_record,
    environment,
    finish,
    in_turn,
    output_kind,
    print_table,
    start_decoding,
    time_engine_steps,
    write_json,
)

HOST_PHASES = ("schedule", "prepare", "update", "output", "detokenize")
BACKEND_OF = {"host-only": "fixed-tokens", "jax": "jax", "torch": "torch"}


def make_llm(runner: str, batch: int, args):
    """An engine for batches up to `batch`: a step's token budget holds every sequence's
    decode token and as many prompt tokens again."""
    from pagedjax import LLM
    from pagedjax.model_loader.demo import demo_model_dirs

    max_num_batched_tokens = max(args.max_num_batched_tokens, 2 * batch)
    # room for the tokens the first prompts decode while the last ones are computed
    prefill_steps = -(-batch * args.context // (max_num_batched_tokens - batch))
    max_len = args.context + prefill_steps + WARMUP_STEPS + args.steps + 64
    return LLM(demo_model_dirs()[0], backend=BACKEND_OF[runner], dtype="float32",
               max_model_len=max_len, max_num_seqs=batch,
               max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)


def time_steps(llm, batch: int, num_steps: int) -> dict:
    """Mean µs per step of each phase over num_steps steps, and the median step."""
    seconds = time_engine_steps(llm, batch, num_steps)
    timings = llm.engine.step_timings
    us = {name: 1e6 * s / timings.num_steps for name, s in timings.seconds.items()}
    host = sum(us.get(p, 0.0) for p in HOST_PHASES)
    return {"phases us/step": us, "host us/step": host, "host us/seq": host / batch,
            "step us (median)": 1e6 * statistics.median(seconds)}


def measure(runner: str, args, round_index: int, output_kind) -> list[dict]:
    """Every batch size on one engine of this runner (started anew each round)."""
    start = time.perf_counter()
    llm = make_llm(runner, max(args.batch_sizes), args)
    startup = time.perf_counter() - start
    rows = []
    for batch in args.batch_sizes:
        ids = start_decoding(llm, batch, args.context, output_kind=output_kind,
                             max_tokens=llm.engine.config.max_model_len - args.context,
                             seed=1000 * round_index + batch)
        row = {"runner": runner, "round": round_index, "batch": batch, "startup s": startup,
               **time_steps(llm, batch, args.steps)}
        finish(llm, ids)
        print(f"round {round_index} {runner:9} batch {batch:4}: host {row['host us/step']:8.1f}"
              f" us/step ({row['host us/seq']:.2f} us/seq), step {row['step us (median)']:.0f}"
              f" us, phases { {k: round(v, 1) for k, v in row['phases us/step'].items()} }",
              flush=True)
        rows.append(row)
    llm.shutdown()
    return rows


def summary(rows: list[dict], runners: list[str], batch_sizes: list[int]) -> list[dict]:
    """Median over rounds of each (runner, batch): host µs/step and per sequence, and each
    phase."""
    out = []
    for runner in runners:
        for batch in batch_sizes:
            mine = [r for r in rows if r["runner"] == runner and r["batch"] == batch]
            phases = {name: statistics.median(r["phases us/step"][name] for r in mine)
                      for name in mine[0]["phases us/step"]}
            host = [r["host us/step"] for r in mine]
            out.append({"runner": runner, "batch": batch,
                        "host us/step": statistics.median(host),
                        "host us/step (rounds)": [round(h, 1) for h in host],
                        "host us/seq": statistics.median(host) / batch,
                        "step us": statistics.median(r["step us (median)"] for r in mine),
                        **{f"{name} us": value for name, value in phases.items()}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", nargs="+", choices=tuple(BACKEND_OF),
                        default=list(BACKEND_OF))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="a step's token budget (at least twice the largest batch)")
    add_output_kind_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()

    rows = []
    for r in range(args.rounds):  # each round starts one runner later: none always first
        for runner in in_turn(args.runners, r):
            rows += measure(runner, args, r, output_kind(args))
    table = summary(rows, args.runners, args.batch_sizes)
    print(f"\nmedian of {args.rounds} rounds, {args.steps} steps each, context {args.context}, "
          f"output kind {args.output_kind}")
    print_table(table, ["runner", "batch", "host us/step", "host us/seq", "schedule us",
                        "prepare us", "launch us", "update us", "output us", "detokenize us",
                        "execute us", "step us"])
    env = environment()
    path = write_json(f"host_overhead_{args.output_kind}_{accelerator_tag(env)}.json",
                      {"args": args_record(args), "summary": table, "rounds": rows,
                       "environment": env}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
