"""Where a speculative batch's time goes beside its decode steps: the speculation policy's
per-step estimates replayed against a whole batch, next to the batch measured end to end.

For one prompt set and batch size B (the demo pair, greedy, EOS ignored):
1. k = 0, each fixed k and the adaptive policy run the same groups of B prompts end to end, the
   engines taking turns group by group (seconds per batch, every group counted). Each engine
   step's seconds are recorded with the sequences it held and whether it was a decode step
   (every sequence past its prompt, none waiting): a mode's t(bucket) is the median of its
   decode steps at that batch bucket;
2. a replay: greedy output does not depend on k, so the draft's teacher-forced argmax over prompt
   + output (one forward of the draft, HF transformers) gives every request's acceptance at
   every position; each batch's decode steps are replayed for each fixed k, every sequence
   advancing by its accepted drafts + 1, each step costing that mode's t(bucket of the
   sequences left);
3. the adaptive policy's own estimates t(B, k) (`AdaptiveSpeculation.seconds`) beside them.
The replayed decode seconds beside the measured batch seconds split what a per-step rate
E(k)/t(k) sees from what it does not (the draft's prefill, catch-ups, mixed steps); the replay's
step count beside (max_tokens - 1) / E(k) shows the batch's slowest sequence. Writes
spec_replay.json to --out.

    python benchmarks/probes/spec_replay.py [--prompt-set edit] [--batch 32] [--backend jax]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import add_out_argument, environment, print_table, write_json  # noqa: E402
from spec_decode import PROMPT_SETS, prompt_set  # noqa: E402


def accepted(matches: np.ndarray, pos: int, k: int) -> int:
    """Drafts accepted at output position pos with k drafts: the leading matches."""
    run = matches[pos : pos + k]
    return int(np.argmin(run)) if not run.all() else len(run)


def teacher_forced_matches(draft_dir: str, prompts: list[list[int]], outputs: list[list[int]]
                           ) -> list[np.ndarray]:
    """[N] per request: whether the draft's argmax after prompt + output[:i] is output[i]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    matches = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            predicted = model(torch.tensor([prompt + out[:-1]])).logits[0].argmax(-1).numpy()
            matches.append(predicted[len(prompt) - 1 :] == np.asarray(out))
    return matches


def record_steps(llm, log: list[tuple[int, bool, float]]) -> None:
    """Log (sequences running, decode step?, seconds) of every engine step the LLM takes."""
    engine, step = llm.engine, llm.engine.step
    scheduler = engine.engine_core.scheduler

    def timed():
        decode = not scheduler.waiting and all(
            s.num_computed_tokens >= s.num_tokens - 1 for s in scheduler.running)
        running, start = len(scheduler.running), time.perf_counter()
        result = step()
        log.append((running, decode, time.perf_counter() - start))
        return result

    engine.step = timed


def decode_step_seconds(log: list[tuple[int, bool, float]], bucket) -> dict[int, float]:
    """Batch bucket → median seconds of the logged decode steps at it."""
    by_bucket: dict[int, list[float]] = {}
    for running, decode, seconds in log:
        if decode and running:
            by_bucket.setdefault(bucket(running), []).append(seconds)
    return {b: float(np.median(v)) for b, v in by_bucket.items()}


def replay(matches: list[np.ndarray], k: int, seconds: dict[int, float], bucket
           ) -> tuple[int, float]:
    """(decode steps, seconds) of one batch at fixed k: output[0] comes from the prompt step."""
    pos = np.ones(len(matches), np.int64)
    lengths = np.array([len(m) for m in matches])
    steps, total = 0, 0.0
    while True:
        active = np.flatnonzero(pos < lengths)
        if not len(active):
            return steps, total
        b = bucket(len(active))  # a bucket this mode never decoded at: the next one up
        b = min((m for m in seconds if m >= b), default=max(seconds))
        steps, total = steps + 1, total + seconds[b]
        for i in active:
            pos[i] += accepted(matches[i], int(pos[i]), k) + 1


def main() -> None:
    from pagedjax import LLM, SamplingParams
    from pagedjax.model_loader.demo import demo_model_dirs

    target, draft = demo_model_dirs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-set", default="edit", choices=PROMPT_SETS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--backend", default="jax", choices=("jax", "torch"))
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--groups", type=int, default=4, help="batches of --batch prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_out_argument(parser)
    args = parser.parse_args()

    max_k = max(args.ks)
    configs = {"k=0": None,
               **{f"k={k}": {"model": draft, "num_speculative_tokens": k, "adaptive": False}
                  for k in args.ks},
               "adaptive": {"model": draft, "num_speculative_tokens": max_k, "adaptive": True}}
    llms = {name: LLM(target, backend=args.backend, max_model_len=512, max_num_seqs=args.batch,
                      speculative_config=spec,
                      gpu_memory_utilization=0.9 * (i + 1) / len(configs))
            for i, (name, spec) in enumerate(configs.items())}
    prompts = prompt_set(args.prompt_set, llms["k=0"].get_tokenizer(), args.batch * args.groups)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    groups = [prompts[g * args.batch : (g + 1) * args.batch] for g in range(args.groups)]
    seconds = dict.fromkeys(llms, 0.0)
    logs: dict[str, list] = {name: [] for name in llms}
    for name, llm in llms.items():
        record_steps(llm, logs[name])
    outputs: list[list[int]] = []
    for group in groups:
        for name, llm in llms.items():
            start = time.perf_counter()
            result = llm.generate([{"prompt_token_ids": p} for p in group], params,
                                  use_tqdm=False)
            seconds[name] += time.perf_counter() - start
            if name == "k=0":
                outputs += [list(o.outputs[0].token_ids) for o in result]
    policy = llms["adaptive"].engine.engine_core.speculation
    bucket = policy.shapes.seq_bucket
    step_seconds = {name: decode_step_seconds(log, bucket) for name, log in logs.items()}
    for llm in llms.values():
        llm.shutdown()

    matches = teacher_forced_matches(draft, prompts, outputs)
    acceptance = [float(np.mean([accepted(m, p, j + 1) > j for m in matches
                                 for p in range(1, len(m))])) for j in range(max_k)]
    rows = []
    for name, k in [("k=0", 0), *((f"k={k}", k) for k in args.ks)]:
        steps = total = 0.0
        for g in range(args.groups):
            s, t = replay(matches[g * args.batch : (g + 1) * args.batch], k,
                          step_seconds[name], bucket)
            steps, total = steps + s, total + t
        measured = seconds[name] / args.groups
        rows.append({"mode": name, "batch ms (measured)": 1e3 * measured,
                     "decode steps (replay)": steps / args.groups,
                     "decode ms (replay)": 1e3 * total / args.groups,
                     "rest ms": 1e3 * (measured - total / args.groups),
                     "decode step ms": {b: round(1e3 * t, 2) for b, t in
                                        sorted(step_seconds[name].items())},
                     "policy's t(B, k) ms": 1e3 * policy.seconds(bucket(args.batch), k),
                     "E(k) (replay's acceptance)": 1 + sum(acceptance[:k])})
    rows.append({"mode": "adaptive", "batch ms (measured)": 1e3 * seconds["adaptive"] / args.groups,
                 "steps per k": list(policy.steps_per_k)})
    print(f"{args.prompt_set} at batch {args.batch} on {args.backend}, {args.groups} batches; "
          f"mean prompt {np.mean([len(p) for p in prompts]):.0f} tokens; acceptance of the "
          f"first 1..{max_k} drafts {[round(a, 2) for a in acceptance]}")
    print_table(rows, ["mode", "batch ms (measured)", "decode steps (replay)",
                       "decode ms (replay)", "rest ms", "decode step ms", "policy's t(B, k) ms",
                       "E(k) (replay's acceptance)"])
    path = write_json("spec_replay.json", {"args": vars(args), "acceptance": acceptance,
                                           "results": rows, "environment": environment()},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
