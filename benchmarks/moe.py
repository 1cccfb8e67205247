"""A mixture of experts beside the dense model with the same active parameters, per backend.

Two random checkpoints made here (float32): Qwen3-MoE's shape (--experts experts, top
--top-k, hidden --hidden, --layers layers, experts of --moe-intermediate) and a dense Qwen3
whose MLP is as wide as the k experts a token runs (intermediate = top_k * moe_intermediate,
the same attention): per token they compute the same. As a user meets them: timed from the
moment `LLM(...)` returns and one small request; the models take turns round by round.
- batch-1 decode ms/token: (t(N tokens) - t(1 token)) / (N - 1), over fresh random prompts;
- offline throughput: --num-requests prompts of 64 tokens, 64 greedy tokens each (EOS ignored).
Reports the MoE's time over the dense twin's (the issue's target: at most 1.2x at batch 1).

    python benchmarks/moe.py [--backends torch jax] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_out_argument, environment, in_turn, print_table, write_json  # noqa: E402


def make_checkpoints(args, root: Path) -> dict[str, str]:
    """{"moe": dir, "dense": dir}: random Qwen3-MoE and its dense twin, one tokenizer."""
    from pagedjax.testing.checkpoints import make_tiny_checkpoint

    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                  head_dim=64, max_position_embeddings=1024, initializer_range=0.02)
    moe = make_tiny_checkpoint(root / "moe", "qwen3_moe", **common, num_experts=args.experts,
                               num_experts_per_tok=args.top_k, mlp_only_layers=[],
                               moe_intermediate_size=args.moe_intermediate)
    dense = make_tiny_checkpoint(root / "dense", "qwen3", **common,
                                 intermediate_size=args.top_k * args.moe_intermediate)
    return {"moe": str(moe), "dense": str(dense)}


def decode_ms_per_token(llm, rng: np.random.Generator, vocab: int, max_tokens: int) -> float:
    from pagedjax import SamplingParams

    def seconds(prompt: list[int], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return time.perf_counter() - start

    times = []
    for _ in range(3):
        prompt = rng.integers(1, vocab, 32).tolist()
        times.append((seconds(prompt, max_tokens) - seconds(prompt, 1)) / (max_tokens - 1))
    return 1e3 * statistics.mean(times)


def throughput(llm, rng: np.random.Generator, vocab: int, num_requests: int) -> float:
    from pagedjax import SamplingParams

    prompts = [{"prompt_token_ids": rng.integers(1, vocab, 64).tolist()}
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["torch", "jax"])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    add_out_argument(parser)
    args = parser.parse_args()

    from pagedjax import LLM
    from pagedjax.config import ModelConfig

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_checkpoints(args, Path(tmp))
        vocab = ModelConfig.from_pretrained(dirs["moe"]).vocab_size
        for backend in args.backends:
            llms, startup = {}, {}
            for name, path in dirs.items():
                start = time.perf_counter()
                llms[name] = LLM(path, backend=backend, max_model_len=512,
                                 max_num_seqs=args.num_requests)
                startup[name] = time.perf_counter() - start
                llms[name].generate("x", use_tqdm=False)  # one small request
            decode = {name: [] for name in llms}
            tput = {name: [] for name in llms}
            for r in range(args.rounds):
                for name in in_turn(list(llms), r):
                    rng = np.random.default_rng(r)
                    decode[name].append(decode_ms_per_token(llms[name], rng, vocab,
                                                            args.max_tokens))
                    tput[name].append(throughput(llms[name], rng, vocab, args.num_requests))
            for name in llms:
                rows.append({
                    "backend": backend, "model": name, "startup s": startup[name],
                    "decode ms/token": statistics.mean(decode[name]),
                    "rounds ms/token": [round(x, 2) for x in decode[name]],
                    "output tok/s": statistics.mean(tput[name]),
                    "× dense time (batch 1)": statistics.mean(decode[name])
                    / statistics.mean(decode["dense"]),
                    "× dense tok/s": statistics.mean(tput[name]) / statistics.mean(tput["dense"]),
                })
            for llm in llms.values():
                llm.shutdown()
    print_table(rows, ["backend", "model", "startup s", "decode ms/token", "rounds ms/token",
                       "output tok/s", "× dense time (batch 1)", "× dense tok/s"])
    path = write_json("moe.json", {"args": vars(args), "results": rows,
                                   "environment": environment()}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
