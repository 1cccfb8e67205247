"""A speculative engine whose draft never pays beside a plain engine: seconds per batch, both
alive in one process, taking turns.

The draft is a random-weight model of the demo draft's config, so its drafts are all but never
accepted and the adaptive policy settles on k = 0 but for its probes. What that engine then
costs beyond the plain one is speculation's overhead where it buys nothing (the draft's prefill
of sentinel prompts, the probes, and any decode step that cannot launch ahead). Each batch: B
code prompts from the standard library (spec_decode.py's set), --max-tokens greedy tokens.
Reports the median of the batches after the first two, per engine, and the engine's steps per
k and the decode steps it launched ahead (async scheduling).

    python benchmarks/probes/spec_drafting_off.py [--backend jax|torch] [--batch-size 16]
        [--batches 10] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: spec_decode.py
from spec_decode import prompt_set  # noqa: E402


def random_draft(like: str, out: Path) -> str:
    """A checkpoint of `like`'s config and tokenizer with random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like)).save_pretrained(out)
    AutoTokenizer.from_pretrained(like).save_pretrained(out)
    return str(out)


def count_ahead(llm) -> dict[str, int]:
    """Counts the decode steps the engine schedules ahead (Scheduler.schedule_next)."""
    scheduler, counter = llm.engine.scheduler, {"ahead": 0}
    schedule_next = scheduler.schedule_next

    def counted(last):
        out = schedule_next(last)
        counter["ahead"] += out is not None
        return out

    scheduler.schedule_next = counted
    return counter


def main() -> None:
    from pagedjax import LLM, SamplingParams
    from pagedjax.model_loader.demo import demo_model_dirs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "torch"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    target, draft = demo_model_dirs()
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model": random_draft(draft, Path(tmp)), "num_speculative_tokens": 4}
        llms = {name: LLM(target, backend=args.backend, max_model_len=512,
                          max_num_seqs=args.batch_size, speculative_config=config)
                for name, config in (("speculative", spec), ("plain", None))}
        ahead = {name: count_ahead(llm) for name, llm in llms.items()}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        b = args.batch_size
        prompts = prompt_set("code", llms["plain"].get_tokenizer(), b * args.batches)
        seconds: dict[str, list[float]] = {name: [] for name in llms}
        for i in range(args.batches):
            for name, llm in llms.items():
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts[i * b:(i + 1) * b]],
                             params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - start)
        median = {name: statistics.median(s[2:]) for name, s in seconds.items()}
        for name in llms:
            print(f"{name}: {median[name]:.3f} s a batch (median of the last {args.batches - 2}), "
                  f"{ahead[name]['ahead']} decode steps launched ahead")
        print(f"speculative / plain: {median['speculative'] / median['plain']:.3f}; steps per k "
              f"{llms['speculative'].get_metrics()['spec_decode_steps_per_k']}")
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
