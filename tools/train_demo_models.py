"""Train the embedded demo model pair: a ~9M-parameter Llama TARGET and a ~1M-parameter DRAFT.

What: both models are trained from scratch on this Python's standard library source (every
`*.py` under `sysconfig.get_paths()["stdlib"]`, minus tests, idlelib, encodings tables and
the like; whole files are held out for evaluation), documents joined by the EOS token, with one
byte-level BPE tokenizer (`pagedjax.testing.checkpoints.train_tokenizer`) shared by both. They
are saved as bf16 safetensors Hugging Face checkpoints in `pagedjax/demo_models/{target,draft}/`,
each with a `training_summary.json` (sizes, steps, losses vs a unigram baseline, tokens seen,
wall time, device, draft/target greedy agreement, sample generations, the command).

Why: the engine, its tests and the speculative-decoding path need a real (not random) model pair
that ships inside the package (no model hub): a target whose greedy text looks like Python and a
draft that shares its tokenizer and agrees with it often. The draft can be partly distilled from
the target's logits (`--distill-frac`), which raises that agreement (≈ the acceptance rate α).

Run: `python tools/train_demo_models.py` (CUDA if available, bf16 autocast). The shipped
pair was trained on 2 shared CPU cores with `--time-budget-min 21 --target-share 0.8
--batch-size 8 --seq-len 256 --lr 3e-3 --warmup 15 --eval-every 25 --distill-frac 0.4`
(see each `training_summary.json`). On that budget the target saw ~1.7M tokens and is still
under-trained (the cheaper draft ends with a lower held-out loss); a GPU run with the defaults
trains both much further. Training stops at the step count or at the time budget, whichever
comes first; the cosine schedule follows whichever is nearer. The shipped draft was then
distilled on the target's own continuations by `tools/distill_draft.py` (its summary's
`sequence_distillation` entry).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedjax.testing.checkpoints import train_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "pydoc_data", "encodings", "turtledemo",
             "__phello__", "lib2to3", "ensurepip", "venv", "__pycache__"}
TARGET_ARCH = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32)
DRAFT_ARCH = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
PROMPTS = ("def ", "import os\n", "class ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "pagedjax" / "demo_models"))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps-target", type=int, default=4000)
    p.add_argument("--steps-draft", type=int, default=3000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (both models)")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="wall-time budget for training both models together")
    p.add_argument("--target-share", type=float, default=0.75,
                   help="fraction of the time budget given to the target")
    p.add_argument("--distill-frac", type=float, default=0.5,
                   help="last fraction of draft training that distils the target's logits")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer-files", type=int, default=200,
                   help="train the tokenizer on this many (random) training files")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return p.parse_args(argv)


# ---------------------------------------------------------------- data


def stdlib_files() -> list[Path]:
    """All Python source files of the standard library, minus tests and generated tables."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def load_split(seed: int) -> tuple[list[str], list[str], list[str]]:
    """(train texts, held-out texts, held-out names): every 25th file (seeded offset) held out."""
    files = stdlib_files()
    offset = seed % 25
    train, held, names = [], [], []
    for i, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        if (i + offset) % 25 == 0:
            held.append(text)
            names.append(path.name)
        else:
            train.append(text)
    return train, held, names


def encode_stream(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> torch.Tensor:
    """One long token stream: each document followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_batch(stream: torch.Tensor, batch: int, seq_len: int,
                 gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of seq_len + 1 tokens (inputs and shifted labels)."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping held-out windows spread evenly over the stream (deterministic)."""
    n = (len(stream) - 1) // seq_len
    idx = torch.linspace(0, n - 1, min(n, max_windows)).long().tolist()
    return torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in idx])


def unigram_loss(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy (nats/token) of an add-one smoothed unigram model of train."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[held].mean())


# ---------------------------------------------------------------- models


def make_model(arch: dict, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A fresh float32 LlamaForCausalLM with tied embeddings and the tokenizer's ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=1024,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.eos_token_id, **arch)
    return LlamaForCausalLM(config).float()


def n_params(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% over `progress` (0..1, steps or time)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model: PreTrainedModel, lr: float) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=None)


def autocast(device: str) -> torch.autocast:
    """bf16 autocast (CUDA always; CPU too: several times faster there on AVX512-BF16)."""
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, windows: torch.Tensor, device: str,
                 chunk: int = 8) -> float:
    """Mean next-token cross-entropy over held-out windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), chunk):
        w = windows[i:i + chunk].to(device)
        with autocast(device):
            logits = model(input_ids=w[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    model.train()
    return total / count


# ---------------------------------------------------------------- training


def step_loss(model: PreTrainedModel, batch: torch.Tensor, device: str,
              teacher: PreTrainedModel | None = None) -> torch.Tensor:
    """Cross-entropy on the data, averaged with KL(teacher || model) when a teacher is given."""
    x, y = batch[:, :-1], batch[:, 1:]
    with autocast(device):
        logits = model(input_ids=x).logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    if teacher is None:
        return ce
    with torch.no_grad(), autocast(device):
        t_logits = teacher(input_ids=x).logits.float()
    kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1),
                  F.log_softmax(t_logits, -1).flatten(0, 1), log_target=True,
                  reduction="batchmean")
    return 0.5 * ce + 0.5 * kl


def train(model: PreTrainedModel, name: str, data: dict, args: argparse.Namespace, steps: int,
          budget_s: float | None, teacher: PreTrainedModel | None = None) -> dict:
    """Train `model` for `steps` or `budget_s` seconds; returns the run's statistics."""
    device, gen = data["device"], torch.Generator().manual_seed(args.seed + len(name))
    model.to(device).train()
    opt, log = make_optimizer(model, args.lr), []
    start, step, recent, ce_recent = time.perf_counter(), 0, [], []
    while step < steps:
        elapsed = time.perf_counter() - start
        progress = max(step / steps, elapsed / budget_s if budget_s else 0.0)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args)
        distil = teacher is not None and progress >= 1.0 - args.distill_frac
        batch = random_batch(data["train"], args.batch_size, args.seq_len, gen).to(device)
        loss = step_loss(model, batch, device, teacher if distil else None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.item())
        if step % args.eval_every == 0 or step == 1:
            entry = {"step": step, "time_s": round(time.perf_counter() - start, 1),
                     "train_loss": round(sum(recent) / len(recent), 4), "distil": distil,
                     "heldout_loss": round(heldout_loss(model, data["eval_small"], device), 4)}
            log.append(entry)
            ce_recent = recent
            recent = []
            print(f"[{name}] {entry} lr={opt.param_groups[0]['lr']:.2e}", flush=True)
    wall = time.perf_counter() - start
    tail = recent or ce_recent
    return {"steps": step, "tokens_seen": step * args.batch_size * args.seq_len,
            "train_wall_s": round(wall, 1), "train_loss_last": round(sum(tail) / len(tail), 4),
            "train_loss_is_distil_mix": bool(teacher is not None and args.distill_frac > 0),
            "log": log}


def save_bf16(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
              out_dir: Path) -> float:
    """Save bf16 safetensors + tokenizer; returns the directory's size in MB."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return sum(f.stat().st_size for f in out_dir.iterdir()) / 1e6


# ---------------------------------------------------------------- verification


@torch.no_grad()
def greedy_samples(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   n_tokens: int = 40) -> dict[str, str]:
    """Greedy continuations (float32, HF generate) of the standard prompts."""
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        gen = model.generate(ids, max_new_tokens=n_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        out[prompt] = tokenizer.decode(gen[0, ids.shape[1]:])
    return out


@torch.no_grad()
def pair_eval(target: PreTrainedModel, draft: PreTrainedModel, windows: torch.Tensor,
              chunk: int = 8) -> dict:
    """One float32 pass over held-out windows: both losses and the fraction of positions where
    the draft's and the target's next-token argmaxes agree."""
    same, count, losses = 0, 0, {"target": 0.0, "draft": 0.0}
    for i in range(0, len(windows), chunk):
        x, y = windows[i:i + chunk, :-1], windows[i:i + chunk, 1:].flatten()
        logits = {"target": target(input_ids=x).logits, "draft": draft(input_ids=x).logits}
        for role, lg in logits.items():
            losses[role] += float(F.cross_entropy(lg.flatten(0, 1), y, reduction="sum"))
        same += int((logits["target"].argmax(-1) == logits["draft"].argmax(-1)).sum())
        count += y.numel()
    return {"agreement_heldout": round(same / count, 4),
            **{r: {"heldout_loss_fp32_reload": round(v / count, 4)} for r, v in losses.items()}}


@torch.no_grad()
def greedy_agreement(target: PreTrainedModel, draft: PreTrainedModel,
                     tokenizer: PreTrainedTokenizerBase, n_tokens: int = 64) -> float:
    """Agreement along the target's own greedy continuations (what greedy speculation sees)."""
    same, count = 0, 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        seq = target.generate(ids, max_new_tokens=n_tokens, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)
        n = ids.shape[1]
        d = draft(input_ids=seq[:, :-1]).logits.argmax(-1)[0, n - 1:]
        same += int((d == seq[0, n:]).sum())
        count += seq.shape[1] - n
    return same / count


def verify(out: Path, windows: torch.Tensor) -> dict:
    """Reload both checkpoints with transformers (float32): samples and draft/target agreement."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "target")
    models = {r: AutoModelForCausalLM.from_pretrained(out / r, dtype=torch.float32).eval()
              for r in ("target", "draft")}
    result = pair_eval(models["target"], models["draft"], windows)
    for role, model in models.items():
        result[role]["samples"] = greedy_samples(model, tok)
    result["agreement_target_greedy"] = round(
        greedy_agreement(models["target"], models["draft"], tok), 4)
    for role in ("target", "draft"):
        for prompt, text in result[role]["samples"].items():
            print(f"--- {role} greedy {prompt!r}:\n{prompt}{text}", flush=True)
    return result


# ---------------------------------------------------------------- main


def prepare(args: argparse.Namespace, device: str) -> tuple[PreTrainedTokenizerBase, dict]:
    """Tokenizer (trained on a random subset of training files) and the token streams."""
    train_texts, held_texts, held_names = load_split(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    pick = torch.randperm(len(train_texts), generator=gen)[:args.tokenizer_files].tolist()
    t0 = time.perf_counter()
    tokenizer = train_tokenizer([train_texts[i] for i in pick], args.vocab_size)
    train, held = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, held_texts)
    print(f"tokenizer {len(tokenizer)} + encode: {time.perf_counter() - t0:.1f}s; "
          f"{len(train_texts)} train files ({len(train)} tokens, "
          f"{sum(map(len, train_texts)) / len(train):.2f} chars/token), "
          f"{len(held_texts)} held-out files ({len(held)} tokens)", flush=True)
    data = {"device": device, "train": train, "held": held, "held_names": held_names,
            "n_train_files": len(train_texts),
            "eval_small": eval_windows(held, args.seq_len, 8),
            "eval_full": eval_windows(held, args.seq_len, 32)}
    data["unigram"] = unigram_loss(train, data["eval_full"][:, 1:].flatten(), len(tokenizer))
    return tokenizer, data


def run_one(role: str, arch: dict, tokenizer: PreTrainedTokenizerBase, data: dict,
            args: argparse.Namespace, steps: int, budget_s: float | None,
            teacher: PreTrainedModel | None = None) -> tuple[PreTrainedModel, dict]:
    """Build, train and evaluate one model; returns it (still float32) and its statistics."""
    torch.manual_seed(args.seed + (role == "draft"))
    model = make_model(arch, tokenizer)
    emb = model.get_input_embeddings().weight.numel()
    print(f"[{role}] {n_params(model) / 1e6:.2f}M params ({(n_params(model) - emb) / 1e6:.2f}M "
          f"non-embedding); budget {budget_s or 0:.0f}s, max {steps} steps", flush=True)
    stats = train(model, role, data, args, steps, budget_s, teacher)
    stats["heldout_loss"] = round(heldout_loss(model, data["eval_full"], data["device"]), 4)
    stats.update(params=n_params(model), params_non_embedding=n_params(model) - emb,
                 architecture=dict(arch, vocab_size=len(tokenizer), tie_word_embeddings=True,
                                   max_position_embeddings=1024))
    print(f"[{role}] done: {stats['steps']} steps, held-out {stats['heldout_loss']} "
          f"(unigram {data['unigram']:.4f}), {stats['train_wall_s']}s", flush=True)
    return model, stats


def summaries(args: argparse.Namespace, data: dict, stats: dict, checks: dict,
              sizes: dict, t_start: float) -> None:
    """Write training_summary.json into both checkpoint directories."""
    import transformers

    out = Path(args.out)
    common = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "device": data["device"] if data["device"] == "cpu" else torch.cuda.get_device_name(),
        "autocast": "bfloat16", "saved_dtype": "bfloat16", "seed": args.seed,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "peak_lr": args.lr,
        "warmup_steps": args.warmup, "time_budget_min": args.time_budget_min,
        "threads": args.threads, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0],
        "data": {"source": "Python stdlib *.py (sysconfig stdlib), skipping "
                           + ",".join(sorted(SKIP_DIRS)),
                 "train_files": data["n_train_files"], "train_tokens": len(data["train"]),
                 "heldout_files": data["held_names"], "heldout_tokens": len(data["held"]),
                 "heldout_eval_tokens": int(data["eval_full"][:, 1:].numel())},
        "unigram_heldout_loss": round(data["unigram"], 4),
        "agreement_heldout": checks["agreement_heldout"],
        "agreement_target_greedy": checks["agreement_target_greedy"],
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "shipped_mb": {k: round(v, 2) for k, v in sizes.items()},
    }
    for role in ("target", "draft"):
        body = dict(role=role, **stats[role], **checks[role], **common)
        if role == "draft":
            body["distill_frac"] = args.distill_frac
        (out / role / "training_summary.json").write_text(json.dumps(body, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if use_cuda else "cpu"
    tokenizer, data = prepare(args, device)
    budget = args.time_budget_min * 60 if args.time_budget_min else None
    target, stats_t = run_one("target", TARGET_ARCH, tokenizer, data, args, args.steps_target,
                              budget * args.target_share if budget else None)
    target.eval().requires_grad_(False)
    draft_budget = budget - (time.perf_counter() - t_start) if budget else None
    teacher = target if args.distill_frac > 0 else None
    draft, stats_d = run_one("draft", DRAFT_ARCH, tokenizer, data, args, args.steps_draft,
                             max(draft_budget, 60.0) if budget else None, teacher)
    out = Path(args.out)
    sizes = {r: save_bf16(m, tokenizer, out / r) for r, m in (("target", target), ("draft", draft))}
    checks = verify(out, data["eval_full"].cpu())
    print(f"agreement held-out {checks['agreement_heldout']:.3f}, along target greedy "
          f"{checks['agreement_target_greedy']:.3f}; sizes MB {sizes}", flush=True)
    summaries(args, data, {"target": stats_t, "draft": stats_d}, checks, sizes, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
