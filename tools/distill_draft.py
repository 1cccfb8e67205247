"""Sequence-level distillation of the demo draft on the demo target's own continuations.

What: the target (served by pagedjax) continues random windows of its training corpus (the
standard library's source: the training split of `train_demo_models.py`), half greedily and half
sampled at temperature 1; the draft is then fine-tuned on those sequences, to match the target's
next-token distribution (forward KL on the target's logits) at every continuation position. This is
the data the draft meets when it speculates: the target's text, not the corpus.

Then both drafts, the shipped one and the distilled one, speculate for the target on prompts cut
from the held-out files (k fixed, greedy and temperature 1), and the script prints the acceptance
per draft position of each. `--ship` replaces the shipped draft only if the distilled one accepts
more at every position, greedy and sampled.

    python tools/distill_draft.py [--num-sequences 1536] [--epochs 3] [--ship]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_models import autocast, encode_stream, load_split, make_optimizer  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.model_loader.demo import demo_model_dirs  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-sequences", type=int, default=1536)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--continuation-len", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="drafts per step while evaluating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ship", action="store_true",
                   help="replace the shipped draft if the distilled one is better everywhere")
    return p.parse_args(argv)


def windows(stream: torch.Tensor, num: int, length: int, seed: int) -> list[list[int]]:
    """num seeded random windows of the token stream."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (num,), generator=gen).tolist()
    return [stream[s : s + length].tolist() for s in starts]


def target_continuations(target: str, prompts: list[list[int]], length: int,
                         seed: int) -> list[list[int]]:
    """prompt + the target's continuation: greedy for the first half, temperature 1 after."""
    llm = LLM(target, max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048)
    half = len(prompts) // 2
    params = [SamplingParams(temperature=0.0 if i < half else 1.0, seed=seed + i,
                             max_tokens=length, ignore_eos=True) for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.shutdown()
    return [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs)]


def distil(draft_dir: str, target_dir: str, sequences: list[list[int]], prompt_len: int,
           args: argparse.Namespace) -> torch.nn.Module:
    """Fine-tune the draft: forward KL to the target on every continuation position."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).train()
    teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    data = torch.tensor(sequences)  # [N, prompt + continuation]
    opt = make_optimizer(draft, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    steps = args.epochs * (len(data) // args.batch_size)
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:  # linear decay to 10 %
            group["lr"] = args.lr * (1.0 - 0.9 * step / steps)
        batch = data[torch.randint(0, len(data), (args.batch_size,), generator=gen)]
        x = batch[:, :-1]
        with torch.no_grad(), autocast("cpu"):
            teacher_logp = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
        with autocast("cpu"):
            logp = F.log_softmax(draft(input_ids=x).logits.float(), -1)
        sl = slice(prompt_len - 1, None)  # positions that predict the continuation
        loss = F.kl_div(logp[:, sl].flatten(0, 1), teacher_logp[:, sl].flatten(0, 1),
                        log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"[distil] step {step + 1}/{steps} KL {loss.item():.4f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    return draft.eval()


def acceptance(target: str, draft: str, prompts: list[list[int]], args: argparse.Namespace,
               temperature: float) -> list[float]:
    """Acceptance per draft position when `draft` speculates k tokens for the target."""
    spec = {"model": draft, "num_speculative_tokens": args.k, "adaptive": False}
    llm = LLM(target, max_model_len=512, max_num_seqs=64, speculative_config=spec)
    params = SamplingParams(temperature=temperature, seed=args.seed, max_tokens=args.eval_tokens,
                            ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rates = llm.get_metrics()["spec_decode_acceptance_per_position"]
    llm.shutdown()
    return [round(r, 4) for r in rates]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, shipped = demo_model_dirs()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    train_texts, held_texts, _ = load_split(0)  # the split the pair was trained with
    train, held = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, held_texts)
    t0 = time.perf_counter()
    sequences = target_continuations(
        target, windows(train, args.num_sequences, args.prompt_len, args.seed),
        args.continuation_len, args.seed)
    print(f"{len(sequences)} target continuations in {time.perf_counter() - t0:.0f}s", flush=True)
    draft = distil(shipped, target, sequences, args.prompt_len, args)

    with tempfile.TemporaryDirectory() as tmp:
        candidate = Path(tmp) / "draft"
        draft.to(torch.bfloat16).save_pretrained(candidate)
        tokenizer.save_pretrained(candidate)
        shutil.copy(Path(shipped) / "generation_config.json", candidate)
        eval_prompts = windows(held, args.eval_prompts, args.prompt_len, args.seed + 1)
        report = {f"temperature {t}": {name: acceptance(target, path, eval_prompts, args, t)
                                       for name, path in (("shipped", shipped),
                                                          ("distilled", str(candidate)))}
                  for t in (0.0, 1.0)}
        print(json.dumps(report, indent=1))
        better = all(d > s for rows in report.values()
                     for s, d in zip(rows["shipped"], rows["distilled"]))
        print(f"distilled draft better at every position: {better}")
        if args.ship and better:
            summary = Path(shipped) / "training_summary.json"
            body = json.loads(summary.read_text())
            body["sequence_distillation"] = {
                "command": "python " + " ".join(sys.argv), "args": vars(args),
                "acceptance_per_position_heldout": report,
                "wall_s": round(time.perf_counter() - t0, 1)}
            shutil.copy(candidate / "model.safetensors", Path(shipped) / "model.safetensors")
            summary.write_text(json.dumps(body, indent=1) + "\n")
            print(f"shipped the distilled draft to {shipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
