"""What a quantization costs on a long English text: SmolLM2-135M-Instruct's perplexity in
float32 and with a quantization= method or an FP8 KV cache, on chunks of the Python reference
manual's topics (pydoc_data, shipped with CPython), with a 90 % interval from the per-chunk
differences; or (--text declaration) on tests/data's text, whole, as issue 46's target reads.

Issue 46's quality target is measured on tests/data's few-KB text, whose perplexity moves by
±2-5 % under perturbations of int8's size (RESULTS.md, stop 68); this one's many chunks say
what the quantization itself costs.

    python benchmarks/probes/quantized_perplexity.py [--backend torch|jax] [--method int8|gguf]
        [--kv-cache-dtype fp8] [--text manual|declaration] [--chunks 16] [--chunk-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics as topics
import statistics
from pathlib import Path


def chunk_nlls(llm, chunks: list[list[int]]) -> list[float]:
    """Each chunk's mean negative log-likelihood of its tokens after the first."""
    from pagedjax import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    return [-statistics.fmean(entry[token].logprob for entry, token in
                              zip(out.prompt_logprobs[1:], chunk[1:], strict=True))
            for out, chunk in zip(outputs, chunks, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch")
    parser.add_argument("--method", default=None, help="the quantization= to compare")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the cache to compare (fp8)")
    parser.add_argument("--text", choices=("manual", "declaration"), default="manual")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    args = parser.parse_args()

    from pagedjax import LLM
    from pagedjax.model_loader.demo import smollm2_instruct_dir, smollm2_instruct_gguf

    if args.method is None and args.kv_cache_dtype == "auto":
        parser.error("nothing to compare: pass --method or --kv-cache-dtype")
    if args.text == "manual":
        text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    else:
        text = (Path(__file__).resolve().parents[2] / "tests" / "data"
                / "declaration_of_independence.txt").read_text()
    label = " + ".join(x for x in (args.method, args.kv_cache_dtype != "auto"
                                   and f"{args.kv_cache_dtype} KV") if x)
    nlls = {}
    for name, method, cache in (("float32", None, "auto"),
                                (label, args.method, args.kv_cache_dtype)):
        # "gguf" keeps the package's Q4_1 file's blocks; float32 is that file dequantized
        model = smollm2_instruct_gguf() if method == "gguf" else smollm2_instruct_dir()
        llm = LLM(model, backend=args.backend, quantization=method, kv_cache_dtype=cache,
                  max_model_len=max(args.chunk_tokens, 1024) + 64,
                  enable_prefix_caching=False, max_num_batched_tokens=args.chunk_tokens)
        ids = llm.get_tokenizer().encode(text)
        n = args.chunk_tokens
        chunks = ([ids] if args.text == "declaration"
                  else [ids[i * n:(i + 1) * n] for i in range(args.chunks)])
        nlls[name] = chunk_nlls(llm, chunks)
        llm.shutdown()
    diffs = [q - f for f, q in zip(nlls["float32"], nlls[label], strict=True)]
    mean = statistics.fmean(diffs)
    half = 1.75 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    print(json.dumps({
        "backend": args.backend, "compared": label, "text": args.text,
        "tokens": sum(map(len, chunks)) - len(chunks),
        "perplexity float32": math.exp(statistics.fmean(nlls["float32"])),
        f"perplexity {label}": math.exp(statistics.fmean(nlls[label])),
        "ratio": math.exp(mean), "ratio 90 %": [math.exp(mean - half), math.exp(mean + half)],
    }, indent=1))


if __name__ == "__main__":
    main()
