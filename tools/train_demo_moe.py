"""Train a small mixture of experts and draw its expert load: docs/images/expert_load.png.

What: a ~3.9M-parameter Qwen3-MoE (4 layers, each with 8 experts, top 2) trained from scratch as
tools/train_demo_models.py trains the demo target (the standard library's source, the demo
target's tokenizer, the same split, batches and schedule), with the load-balancing loss the
architecture trains with (`router_aux_loss_coef`). Then, served by pagedjax (backend="torch"),
it generates greedily for the prompt sets benchmarks/spec_decode.py ships (`code`, `docs`,
`chat`) inside `record_expert_load` (pagedjax/utils/expert_load.py), and the script draws one
heatmap per set, layers × experts: each expert's share of its layer's routes.

Why: the routers' choices are data a user wants to see, and a random router shows only the
tool; there is no model hub here, and the checkpoint (8 MB) does not ship: the picture does.
The shipped picture: the defaults, on a shared 2-core CPU (one torch thread), 1276 steps
(2.6M tokens) in 10 minutes, held-out loss 4.18 nats/token (the unigram baseline: 6.54);
drawing it takes ~5 s.

    python tools/train_demo_moe.py [--out /tmp/demo-moe] [--time-budget-min 10]
    python tools/train_demo_moe.py --model /tmp/demo-moe    # the picture only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "benchmarks"))
from spec_decode import prompt_set  # noqa: E402
from train_demo_models import (  # noqa: E402
    encode_stream,
    eval_windows,
    heldout_loss,
    load_split,
    lr_at,
    make_optimizer,
    random_batch,
    save_bf16,
)

from pagedjax.model_loader.demo import demo_model_dirs  # noqa: E402

MOE_ARCH = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                norm_topk_prob=True, router_aux_loss_coef=0.01)
PROMPT_SETS = ("code", "docs", "chat")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/demo-moe", help="where the checkpoint is saved")
    p.add_argument("--model", default=None, help="an existing MoE checkpoint: no training")
    p.add_argument("--picture", default=str(REPO / "docs" / "images" / "expert_load.png"))
    p.add_argument("--time-budget-min", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (2 spin-wait badly on a shared 2-core host)")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    return p.parse_args(argv)


def make_moe(tokenizer):
    """A fresh float32 Qwen3MoeForCausalLM (tied embeddings) with the tokenizer's ids; its
    forward returns the load-balancing loss (output_router_logits)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=len(tokenizer), max_position_embeddings=1024,
                            tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
                            intermediate_size=4 * MOE_ARCH["hidden_size"],
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                            pad_token_id=tokenizer.eos_token_id, output_router_logits=True,
                            **MOE_ARCH)
    return Qwen3MoeForCausalLM(config).float()


def train(args: argparse.Namespace) -> Path:
    """Train for --steps or --time-budget-min (whichever ends first; the cosine schedule
    follows the nearer); save bf16 with a training_summary.json; return the folder."""
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dirs()[0])
    train_texts, held_texts, _ = load_split(args.seed)
    stream, held = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, held_texts)
    small, full = eval_windows(held, args.seq_len, 8), eval_windows(held, args.seq_len, 32)
    model = make_moe(tokenizer).train()
    opt, gen, log = make_optimizer(model, args.lr), torch.Generator().manual_seed(args.seed), []
    budget, start, step = args.time_budget_min * 60, time.perf_counter(), 0
    while step < args.steps:
        progress = max(step / args.steps, (time.perf_counter() - start) / budget)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args)
        batch = random_batch(stream, args.batch_size, args.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=batch[:, :-1])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss = ce + model.config.router_aux_loss_coef * out.aux_loss.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == 1:
            log.append({"step": step, "time_s": round(time.perf_counter() - start, 1),
                        "train_ce": round(ce.item(), 4), "aux_loss": round(out.aux_loss.item(), 4),
                        "heldout_loss": round(heldout_loss(model, small, "cpu"), 4)})
            print(log[-1], flush=True)
    out_dir = Path(args.out)
    size_mb = save_bf16(model, tokenizer, out_dir)
    summary = {"steps": step, "tokens_seen": step * args.batch_size * args.seq_len,
               "train_wall_s": round(time.perf_counter() - start, 1),
               "heldout_loss": round(heldout_loss(model.float(), full, "cpu"), 4),
               "architecture": MOE_ARCH, "size_mb": round(size_mb, 2), "log": log,
               "command": "python " + " ".join(sys.argv), "torch": torch.__version__}
    (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"saved {out_dir} ({size_mb:.1f} MB): held-out loss {summary['heldout_loss']}")
    return out_dir


def draw(model_dir: Path, args: argparse.Namespace) -> None:
    """One heatmap per prompt set of the expert load of greedy generation, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedjax import LLM, SamplingParams
    from pagedjax.utils.expert_load import plot_expert_load, record_expert_load

    llm = LLM(str(model_dir), backend="torch", max_model_len=512, max_num_seqs=args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    loads = {}
    for name in PROMPT_SETS:
        prompts = prompt_set(name, llm.get_tokenizer(), args.num_prompts)
        with record_expert_load(llm) as loads[name]:
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        print(name, loads[name].counts.tolist(), flush=True)
    vmax = max(load.shares().max() for load in loads.values())  # one color scale
    fig, axes = plt.subplots(1, len(PROMPT_SETS), figsize=(4.2 * len(PROMPT_SETS), 2.6),
                             layout="constrained")
    for ax, (name, load) in zip(axes, loads.items()):
        plot_expert_load(load, num_prompts=args.num_prompts, ax=ax, vmax=vmax,
                         title=f"{name}: {args.num_prompts} prompts, {load.num_tokens} tokens")
    fig.suptitle(f"Expert load of {model_dir.name} (Qwen3-MoE, top 2 of 8), greedy, "
                 f"{args.max_tokens} tokens a prompt")
    Path(args.picture).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.picture, dpi=90)
    print(f"wrote {args.picture}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    draw(Path(args.model) if args.model else train(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
