"""What a quantization costs on a long English text: SmolLM2-135M-Instruct's perplexity with
quantization=None and another method, on chunks of the Python reference manual's topics
(pydoc_data, shipped with CPython), with a 90 % interval from the per-chunk differences.

Issue 46's quality target is measured on tests/data's few-KB text, whose perplexity moves by
±2-5 % under perturbations of int8's size (RESULTS.md, stop 68); this one's many chunks say
what the quantization itself costs.

    python benchmarks/probes/quantized_perplexity.py [--backend torch|jax] [--method int8|gguf]
        [--chunks 16] [--chunk-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics as topics
import statistics


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
    parser.add_argument("--method", default="int8", help="the quantization= to compare")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    args = parser.parse_args()

    from pagedjax import LLM
    from pagedjax.model_loader.demo import smollm2_instruct_dir, smollm2_instruct_gguf

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    nlls = {}
    for method in (None, args.method):
        # "gguf" keeps the package's Q4_1 file's blocks; float32 is that file dequantized
        model = smollm2_instruct_gguf() if method == "gguf" else smollm2_instruct_dir()
        llm = LLM(model, backend=args.backend, quantization=method,
                  max_model_len=args.chunk_tokens + 64, enable_prefix_caching=False,
                  max_num_batched_tokens=args.chunk_tokens)
        ids = llm.get_tokenizer().encode(text)
        n = args.chunk_tokens
        chunks = [ids[i * n:(i + 1) * n] for i in range(args.chunks)]
        nlls[method] = chunk_nlls(llm, chunks)
        llm.shutdown()
    diffs = [q - f for f, q in zip(nlls[None], nlls[args.method], strict=True)]
    mean, half = statistics.fmean(diffs), 1.75 * statistics.stdev(diffs) / len(diffs) ** 0.5
    print(json.dumps({
        "backend": args.backend, "method": args.method,
        "tokens": args.chunks * (args.chunk_tokens - 1),
        "perplexity float32": math.exp(statistics.fmean(nlls[None])),
        f"perplexity {args.method}": math.exp(statistics.fmean(nlls[args.method])),
        "ratio": math.exp(mean), "ratio 90 %": [math.exp(mean - half), math.exp(mean + half)],
    }, indent=1))


if __name__ == "__main__":
    main()
