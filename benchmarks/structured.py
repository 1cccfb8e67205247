"""Structured outputs: what a grammar costs per decode step, what compiling one costs, and that
constrained decoding compiles no new step after startup.

(a) Decode ms/step of the same batch, constrained and unconstrained, at each batch size (default
    1 and 32), on each backend (default both, in one run). The constraint is a JSON schema for
    exactly 100 records (name, age, e-mail, tags: compact JSON), so no completion can finish
    within --max-tokens and both modes decode the same number of tokens from the same prompt
    lengths. Greedy, EOS ignored, fresh random prompt tokens every run; decode ms/step is
    (t(N tokens) - t(1 token)) / (N - 1), as in latency.py, so prefill cancels out. The modes
    take turns run by run, --repeats times: ms/step is the median of a mode's runs, the ratio
    the median of the runs' constrained / unconstrained pairs (back to back, so that a shared
    host's drifting load cancels), with the ratio of the fastest runs beside, and the ratio of
    the median engine step of each mode over all its timed runs. The one-off costs are
    reported apart: LLM(...) (the startup compile) and the first constrained request (the
    grammar's compile, and any step compile it meets). Also the engine's per-phase step times
    (schedule, prepare, execute, update, output) of one more pass of each mode: llguidance fills
    the mask in "schedule", the matchers consume the sampled tokens in "update", and the device
    applies the mask in "execute".
(b) Grammar compile time for the test corpus (tests/support/structured_cases.py: 25 JSON schemas,
    regexes, choices, grammars) through the engine's compiler (grammar_key + GrammarCompiler,
    one worker thread, a fresh compiler per repeat), with and without the first token mask
    (llguidance builds masks lazily), beside xgrammar (the peer; its compile precomputes its
    mask cache, one thread, no cache) where it imports: it needs torch, so it is not a
    dependency; install it beside, without its CUDA dependencies:
        pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi
    and point --xgrammar-path there (the default, when that folder exists).
(c) num_compiles_after_startup of each LLM after the constrained workload (should be 0), and the
    whole corpus decoded once through the engine (sampled, seeded), each output checked against
    its case's language.

    python benchmarks/structured.py [--model DIR] [--backends jax torch] [--batch-sizes 1 32]
                                    [--max-tokens 64] [--repeats 5] [--no-xgrammar] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.support.structured_cases
from common import (  # noqa: E402
    accelerator_tag,
    add_dtype_argument,
    add_out_argument,
    environment,
    print_table,
    stderr_fd_captured,
    step_phases_ms,
    write_json,
)

PROMPT_LEN = 32
TARGET_RATIO = {1: 1.25, 32: 1.10}  # the issue's: constrained / unconstrained ms per step
_RECORD = {"type": "object", "additionalProperties": False,
           "required": ["name", "age", "email", "tags"],
           "properties": {
               "name": {"type": "string", "maxLength": 16},
               "age": {"type": "integer", "minimum": 0, "maximum": 120},
               "email": {"type": "string", "pattern": r"^[a-z]{1,8}@[a-z]{1,8}\.com$"},
               "tags": {"type": "array", "items": {"enum": ["new", "vip", "late"]},
                        "maxItems": 3}}}
# Exactly 100 records (>= 1,500 tokens of compact JSON): no completion finishes in the timed
# runs, so constrained and unconstrained batches decode the same tokens.
WORKLOAD_SCHEMA = {"type": "array", "items": _RECORD, "minItems": 100, "maxItems": 100}
XGRAMMAR_INSTALL = "pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi"


# ---- (b) compile time ------------------------------------------------------------------------


def corpus_compile_times(tokenizer, vocab_size: int, eos: tuple[int, ...], repeats: int
                         ) -> list[dict]:
    """Per corpus case (and the workload schema): median ms over `repeats` fresh compilers of
    the engine's compile (grammar_key + GrammarCompiler) and of compile + the first mask."""
    import llguidance.numpy

    from pagedjax.sampling_params import StructuredOutputsParams
    from pagedjax.structured_output import GrammarCompiler, grammar_key
    from tests.support.structured_cases import CASES

    cases = [(c.name, c.kind, c.params) for c in CASES]
    cases.append(("workload_100_records", "json",
                  StructuredOutputsParams(json=WORKLOAD_SCHEMA, disable_any_whitespace=True)))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    for _ in range(repeats):
        compiler = GrammarCompiler(tokenizer, vocab_size, eos)
        warm = StructuredOutputsParams(regex="a")  # builds llguidance's tokenizer: once per LLM
        compiler.compile(grammar_key(warm)).result()
        for name, _, params in cases:
            start = time.perf_counter()
            matcher = compiler.compile(grammar_key(params)).result()
            compiled = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher.deep_copy(), mask)
            samples[name].append((compiled - start, time.perf_counter() - start))
        compiler.shutdown()
    return [{"case": name, "kind": kind,
             "llguidance compile ms": 1e3 * statistics.median(s[0] for s in samples[name]),
             "llguidance +1st mask ms": 1e3 * statistics.median(s[1] for s in samples[name])}
            for name, kind, _ in cases]


def import_xgrammar(path: str | None):
    """xgrammar, or (None, why not)."""
    if path and Path(path).is_dir() and path not in sys.path:
        sys.path.append(path)
    try:
        import xgrammar
    except Exception as e:  # ImportError, or a broken install (its torch/tvm-ffi)
        return None, f"{type(e).__name__}: {e}"
    return xgrammar, None


def xgrammar_compile_times(xgr, tokenizer, vocab_size: int, eos: tuple[int, ...],
                           rows: list[dict], repeats: int) -> None:
    """Adds xgrammar's median compile ms (and compile + first mask) to each row it can compile:
    JSON schemas (any_whitespace off where the case disables whitespace; a whitespace_pattern
    becomes xgrammar's default flexible whitespace), regexes, choices (as an EBNF alternation)
    and GBNF grammars (not Lark)."""
    from tests.support.structured_cases import CASES_BY_NAME

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(eos))

    def compile_one(compiler, name: str):
        if name == "workload_100_records":
            return compiler.compile_json_schema(json.dumps(WORKLOAD_SCHEMA), any_whitespace=False)
        params = CASES_BY_NAME[name].params
        if params.kind == "json":
            return compiler.compile_json_schema(json.dumps(params.json),
                                                any_whitespace=not params.disable_any_whitespace)
        if params.kind == "regex":
            return compiler.compile_regex(params.regex)
        if params.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in params.choice))
        if "::=" not in params.grammar:
            return None  # Lark: not xgrammar's syntax
        return compiler.compile_grammar(params.grammar)

    for row in rows:
        times = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            start = time.perf_counter()
            try:
                with stderr_fd_captured() as log:
                    compiled = compile_one(compiler, row["case"])
            except Exception as e:  # a schema feature xgrammar lacks
                row["xgrammar note"] = f"{type(e).__name__}: {str(e)[:80]}"
                break
            warnings = sorted(set(re.findall(r"Warning: ([^\n]*)", log["text"])))
            if warnings:  # what it ignored: its language is larger than the schema's
                row["xgrammar note"] = "; ".join(warnings)
            if compiled is None:
                row["xgrammar note"] = "Lark: not xgrammar's syntax"
                break
            done = time.perf_counter()
            bitmask = xgr.allocate_token_bitmask(1, vocab_size)
            xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
            times.append((done - start, time.perf_counter() - start))
        if len(times) == repeats:
            row["xgrammar compile ms"] = 1e3 * statistics.median(t[0] for t in times)
            row["xgrammar +1st mask ms"] = 1e3 * statistics.median(t[1] for t in times)


def summarize_compiles(rows: list[dict]) -> list[dict]:
    """Median and max over the cases of each kind (json: the 25 corpus schemas, the workload
    schema apart), for every timed column."""
    columns = [c for c in ("llguidance compile ms", "llguidance +1st mask ms",
                           "xgrammar compile ms", "xgrammar +1st mask ms")
               if any(c in r for r in rows)]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        group = "workload (100 records)" if r["case"] == "workload_100_records" else r["kind"]
        groups.setdefault(group, []).append(r)
    out = []
    for group, members in groups.items():
        summary = {"cases": group, "n": len(members)}
        for column in columns:
            values = [r[column] for r in members if column in r]
            if values:
                summary[column.replace(" ms", "") + " median ms"] = statistics.median(values)
                summary[column.replace(" ms", "") + " max ms"] = max(values)
        out.append(summary)
    return out


# ---- (a) cost per decode step, (c) compiles after startup ------------------------------------


def make_prompts(vocab_size: int, batch: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(1, vocab_size, PROMPT_LEN).tolist()}
            for _ in range(batch)]


def run_backend(backend: str, args, vocab_size: int) -> tuple[list[dict], dict]:
    """Rows of decode ms/step per (batch, mode), and the backend's one-off costs and checks."""
    from pagedjax import LLM, SamplingParams
    from pagedjax.sampling_params import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(args.model, backend=backend, dtype=args.dtype,
              max_model_len=PROMPT_LEN + args.max_tokens + 512,
              max_num_seqs=max(args.batch_sizes))
    startup = time.perf_counter() - start
    constraint = StructuredOutputsParams(json=WORKLOAD_SCHEMA, disable_any_whitespace=True)

    def params(mode: str, num_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True,
                              structured_outputs=constraint if mode == "constrained" else None)

    # every engine step's wall time in the timed N-token runs, by mode: the median of hundreds
    # of steps per mode is steadier on a shared host than the median of --repeats run pairs
    step_seconds: dict[str, list[float]] = {}
    engine_step = llm.engine.step

    def step_timed() -> list:
        start = time.perf_counter()
        outputs = engine_step()
        if recording is not None:
            recording.append(time.perf_counter() - start)
        return outputs

    llm.engine.step = step_timed
    recording: list[float] | None = None

    def timed(mode: str, prompts: list[dict], num_tokens: int, record: bool = False) -> float:
        nonlocal recording
        recording = step_seconds[mode] if record else None
        start = time.perf_counter()
        outputs = llm.generate(prompts, params(mode, num_tokens), use_tqdm=False)
        seconds = time.perf_counter() - start
        recording = None
        short = [o for o in outputs if len(o.outputs[0].token_ids) != num_tokens]
        if short:  # a constrained completion that finished: the batches would differ
            raise RuntimeError(f"{backend} {mode}: {len(short)} completion(s) of "
                               f"{[len(o.outputs[0].token_ids) for o in short]} tokens, not "
                               f"{num_tokens} ({short[0].outputs[0].finish_reason}): "
                               f"{short[0].outputs[0].text[:200]!r}")
        if mode == "constrained" and not outputs[0].outputs[0].text.startswith("["):
            raise RuntimeError(f"{backend}: the constrained output is not the schema's JSON: "
                               f"{outputs[0].outputs[0].text[:200]!r}")
        return seconds

    # one-off costs, timed apart: a first unconstrained request, then the first constrained
    # one (the grammar's compile, and any step compile a mask meets)
    timed("unconstrained", make_prompts(vocab_size, 1, seed=10_000), 4)
    before = llm.get_metrics()
    start = time.perf_counter()
    timed("constrained", make_prompts(vocab_size, 1, seed=10_001), 4)
    first_constrained = time.perf_counter() - start
    after_first = llm.get_metrics()

    modes = ("unconstrained", "constrained")
    rows = []
    for b in args.batch_sizes:
        step_seconds.update({m: [] for m in modes})
        per_step: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:  # neither always goes first
                seed = 1_000 * b + 10 * r + modes.index(mode) * 2
                t1 = timed(mode, make_prompts(vocab_size, b, seed), 1)
                tn = timed(mode, make_prompts(vocab_size, b, seed + 1), args.max_tokens,
                           record=True)
                per_step[mode].append(1e3 * (tn - t1) / (args.max_tokens - 1))
        phases = {}
        for mode in modes:  # one more pass each, for the per-phase split
            timings = llm.engine.step_timings
            timings.__init__()
            timed(mode, make_prompts(vocab_size, b, seed=777_000 + b), args.max_tokens)
            phases[mode] = step_phases_ms(timings)
        base = per_step["unconstrained"]
        for mode in modes:
            # a shared host's load drifts: the ratio is the median over repeats of each run's
            # constrained / unconstrained pair (run back to back), with the ratio of the fastest
            # runs (the least disturbed) beside it
            paired = statistics.median(c / u for c, u in zip(per_step[mode], base))
            row = {"backend": backend, "batch": b, "mode": mode,
                   "decode ms/step": statistics.median(per_step[mode]),
                   "min ms/step": min(per_step[mode]), "ms/step runs": per_step[mode],
                   "ratio": paired, "ratio of mins": min(per_step[mode]) / min(base),
                   "step ms (median of steps)": 1e3 * statistics.median(step_seconds[mode]),
                   "ratio of step medians": statistics.median(step_seconds[mode])
                   / statistics.median(step_seconds["unconstrained"]),
                   "steps": len(step_seconds[mode]),
                   "schedule ms": phases[mode]["schedule"],
                   "prepare ms": phases[mode]["prepare"], "execute ms": phases[mode]["execute"],
                   "update ms": phases[mode]["update"], "step ms (phases)": phases[mode]["step"],
                   "step phases ms": phases[mode]}
            if mode == "constrained" and b in TARGET_RATIO:
                row["target"] = f"<= {TARGET_RATIO[b]:.2f}"
                row["met"] = "yes" if paired <= TARGET_RATIO[b] else "NO"
            rows.append(row)
    after_workload = llm.get_metrics()
    corpus = decode_corpus(llm)
    final = llm.get_metrics()
    llm.shutdown()
    summary = {
        "backend": backend, "startup s": startup, "first constrained request s": first_constrained,
        "grammar compiles (first request)": after_first.get("grammar_compiles_total"),
        "grammar compile ms (first request)":
            1e3 * after_first.get("grammar_compile_seconds_total", float("nan")),
        "compiles after startup, before the first constrained request":
            before["num_compiles_after_startup"],
        "compiles after startup, after the constrained workload":
            after_workload["num_compiles_after_startup"],
        "compiles after startup, after the corpus": final["num_compiles_after_startup"],
        "structured_output_requests_total": final.get("structured_output_requests_total"),
        "grammar_compiles_total": final.get("grammar_compiles_total"),
        "grammar_compile_seconds_total": final.get("grammar_compile_seconds_total"),
        "corpus outputs valid": f"{corpus['valid']}/{corpus['total']}",
        "corpus": corpus,
    }
    return rows, summary


def decode_corpus(llm) -> dict:
    """Every corpus case once, in one batch, sampled (temperature 1, seeded); each output
    checked against its language, and counted as stopped by its grammar or cut at max_tokens."""
    from pagedjax import SamplingParams
    from tests.support.structured_cases import CASES, max_tokens_for

    prompts = ["Answer in the requested format:\n"] * len(CASES)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(case),
                             structured_outputs=case.params) for i, case in enumerate(CASES)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    failures = []
    for case, output in zip(CASES, outputs):
        completion = output.outputs[0]
        try:
            if completion.finish_reason != "stop":
                raise AssertionError(f"{case.name}: finish_reason {completion.finish_reason!r} "
                                     f"after {len(completion.token_ids)} tokens")
            case.check(completion.text)
        except AssertionError as e:
            failures.append(str(e))
    return {"total": len(CASES), "valid": len(CASES) - len(failures), "failures": failures,
            "seconds": seconds,
            "examples": {c.name: o.outputs[0].text for c, o in list(zip(CASES, outputs))[::6]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint dir (default: the demo target)")
    parser.add_argument("--backends", nargs="+", choices=("jax", "torch"),
                        default=["jax", "torch"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per batch size and mode (the median counts)")
    parser.add_argument("--compile-repeats", type=int, default=5,
                        help="fresh compilers per corpus grammar (the median counts)")
    parser.add_argument("--no-xgrammar", action="store_true", help="skip the xgrammar peer")
    parser.add_argument("--xgrammar-path", default="/tmp/xgr",
                        help="a folder xgrammar was installed into with pip --target, added "
                             "to sys.path if xgrammar does not import as it is")
    parser.add_argument("--skip-steps", action="store_true",
                        help="only (b): the compile times")
    add_dtype_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (decode time is t(N) - t(1))")

    from pagedjax.config import ModelConfig
    from pagedjax.model_loader.demo import demo_model_dirs
    from pagedjax.model_loader.tokenizer import load_eos_token_ids, load_tokenizer

    args.model = args.model or demo_model_dirs()[0]
    load_before = os.getloadavg()  # a shared host: how busy it was, kept with the results
    vocab_size = ModelConfig.from_pretrained(args.model).vocab_size
    tokenizer = load_tokenizer(args.model)
    eos = load_eos_token_ids(args.model, tokenizer)

    # (b) compile times: before any engine (no step competes for the cores)
    compile_rows = corpus_compile_times(tokenizer, vocab_size, eos, args.compile_repeats)
    xgrammar_status = "skipped (--no-xgrammar)"
    if not args.no_xgrammar:
        xgr, why_not = import_xgrammar(args.xgrammar_path)
        if xgr is None:
            xgrammar_status = (f"not run: xgrammar does not import here ({why_not}); "
                               f"{XGRAMMAR_INSTALL}, then --xgrammar-path /tmp/xgr")
        else:
            xgrammar_compile_times(xgr, tokenizer, vocab_size, eos, compile_rows,
                                   args.compile_repeats)
            xgrammar_status = f"xgrammar {_version_of('xgrammar')} (1 thread, no cache)"
    compile_summary = summarize_compiles(compile_rows)

    step_rows, summaries = [], []
    if not args.skip_steps:
        for backend in args.backends:
            rows, summary = run_backend(backend, args, vocab_size)
            step_rows += rows
            summaries.append(summary)

    load_after = os.getloadavg()
    print(f"model {args.model} (vocabulary {vocab_size}); llguidance "
          f"{_version_of('llguidance')}; {xgrammar_status}; load average (1/5/15 min) "
          f"{'/'.join(f'{x:.1f}' for x in load_before)} at the start, "
          f"{'/'.join(f'{x:.1f}' for x in load_after)} at the end on {os.cpu_count()} cores")
    print(f"\n(b) grammar compile ms, median of {args.compile_repeats} fresh compilers per "
          "grammar; median and max over each kind's cases:")
    print_table(compile_summary, list(dict.fromkeys(k for r in compile_summary for k in r)))
    for note in sorted({r["xgrammar note"] for r in compile_rows if "xgrammar note" in r}):
        cases = [r["case"] for r in compile_rows if r.get("xgrammar note") == note]
        print(f"  xgrammar: {note} ({', '.join(cases)})")
    if step_rows:
        print(f"\n(a) decode ms/step, {args.max_tokens} greedy tokens after {PROMPT_LEN}-token "
              f"prompts, median of {args.repeats} runs (ratio: the median of the runs' "
              f"constrained / unconstrained pairs; the target's); ratio of step medians: of "
              f"every step of the {args.max_tokens}-token runs, by mode; constrained: "
              f"{len(_RECORD['required'])}-field records, compact JSON (100 of them: none "
              "finishes)")
        shown = [{**r, **{k: f"{r[k]:.3f}" for k in ("ratio", "ratio of mins",
                                                      "ratio of step medians")},
                  **{k: f"{r[k]:.2f}" for k in ("decode ms/step", "min ms/step",
                                                "step ms (median of steps)")},
                  "target": r.get("target", ""), "met": r.get("met", "")} for r in step_rows]
        print_table(shown, ["backend", "batch", "mode", "decode ms/step", "min ms/step",
                            "ratio", "ratio of mins", "target", "met",
                            "step ms (median of steps)", "ratio of step medians", "schedule ms",
                            "prepare ms", "execute ms", "update ms"])
        print("\none-off costs and (c) checks:")
        print_table(summaries, ["backend", "startup s", "first constrained request s",
                                "grammar compile ms (first request)",
                                "compiles after startup, after the constrained workload",
                                "compiles after startup, after the corpus",
                                "corpus outputs valid"])
        for s in summaries:
            for failure in s["corpus"]["failures"]:
                print(f"  {s['backend']} corpus failure: {failure}")
    env = environment()
    env["versions"]["llguidance"] = _version_of("llguidance")
    env["versions"]["xgrammar"] = _version_of("xgrammar") if "thread" in xgrammar_status else None
    tag = "_".join([*([] if args.skip_steps else args.backends), accelerator_tag(env)])
    path = write_json(f"structured_{tag}.json", {
        "args": vars(args), "workload_schema": WORKLOAD_SCHEMA, "xgrammar": xgrammar_status,
        "load_average_start": load_before, "load_average_end": load_after,
        "compile_summary": compile_summary, "compile_per_case": compile_rows,
        "steps": step_rows, "backends": summaries, "environment": env}, args.out)
    print(f"wrote {path}")


def _version_of(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        module = sys.modules.get(package)
        return getattr(module, "__version__", None)


if __name__ == "__main__":
    main()
