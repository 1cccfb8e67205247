"""pagedjax command line: `pagedjax generate --prompt TEXT [--model DIR] [--backend jax|torch]`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path(os.environ.get("PAGEDJAX_CACHE", Path.home() / ".cache" / "pagedjax"))


def default_model() -> str:
    """The embedded default model: a small Llama built locally on first use (no model hub)."""
    path = DEFAULT_MODEL_DIR / "tiny-llama"
    if not (path / "config.json").is_file():
        from pagedjax.checkpoints import make_tiny_checkpoint

        print(f"building the default model in {path} (once)...", file=sys.stderr)
        make_tiny_checkpoint(path, "llama")
    return str(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    gen.add_argument("--model", help="HF checkpoint directory (default: the embedded model)")
    gen.add_argument("--backend", choices=("jax", "torch"), default="jax")
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt; repeat the flag for a batch")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--num-kv-blocks", type=int, default=None)
    return parser


def generate(args: argparse.Namespace) -> None:
    from pagedjax import LLM, SamplingParams

    llm = LLM(args.model or default_model(), backend=args.backend, dtype=args.dtype,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens,
                            stop=args.stop)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            print(f"--- prompt: {output.prompt!r} [{completion.index}] "
                  f"({completion.finish_reason})")
            print(output.prompt + completion.text)
    tokens = llm.get_metrics()["generation_tokens_total"]
    print(f"--- {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s, backend "
          f"{args.backend})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
