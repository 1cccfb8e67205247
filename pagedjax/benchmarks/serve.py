"""`pagedjax bench serve`: load an OpenAI-compatible server and report latency and throughput
with vLLM's definitions (vllm bench serve):

- TTFT: request sent → first streamed chunk that carries text;
- ITL: the gaps between a request's later text chunks, pooled over all requests;
- TPOT: per request, (E2E − TTFT) / (output tokens − 1), for requests of ≥ 2 tokens;
- E2E: request sent → its last chunk;
- throughput: completed requests, output tokens and all tokens per second of the whole run.

Prompts are random words (seeded); token counts come from the server's `usage`. Arrivals are a
Poisson process at --request-rate (gamma with --burstiness), at most --max-concurrency in flight.

    pagedjax bench serve [--url http://127.0.0.1:8000] [--endpoint /v1/completions]
                         [--num-prompts 100] [--request-rate inf] [--max-concurrency N]
                         [--input-len 64] [--output-len 64] [--ignore-eos] [--result-file FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_WORDS = ("the def return self import class value list data for if else while try with from "
          "as in not and or None True False print range len dict str int float file path "
          "model token cache block request server engine queue batch step time result error "
          "config args kwargs yield async await lambda open read write close index key").split()


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--endpoint", default="/v1/completions",
                        choices=("/v1/completions", "/v1/chat/completions"))
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="the most requests in flight")
    parser.add_argument("--input-len", type=int, default=64, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --output-len tokens")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="each request's temperature (0: greedy; served requests that set "
                             "none sample at 1)")
    parser.add_argument("--num-warmups", type=int, default=1, help="untimed requests first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-keep-alive", action="store_true",
                        help="a connection of its own per request (for servers that close kept-"
                             "alive connections after a few requests, as llama-server does)")
    parser.add_argument("--percentiles", default="50,90,99")
    parser.add_argument("--result-file", default=None, help="write the results as JSON")
    return parser


def make_prompts(num_prompts: int, num_words: int, seed: int = 0) -> list[str]:
    """The benchmark's seeded random-word prompts (the first num_prompts are the timed ones)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=num_words)) for _ in range(num_prompts)]


def _payload(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": args.output_len,
                            "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


async def _send(session, url: str, body: dict[str, Any], headers: dict[str, str]
                ) -> RequestResult:
    result, start = RequestResult(), time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[5:]), time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if _chunk_text(chunk):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e, result.ok = time.perf_counter() - start, True
    except Exception as e:  # a benchmark reports failures; it does not stop on them
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0,
                                     force_close=getattr(args, "no_keep_alive", False))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _first_model(session, args.url, headers)
        prompts = make_prompts(args.num_prompts + args.num_warmups, args.input_len, args.seed)
        url = args.url.rstrip("/") + args.endpoint
        warmups = [_send(session, url, _payload(args, model, p), headers)
                   for p in prompts[args.num_prompts:]]
        for warm in await asyncio.gather(*warmups):
            if not warm.ok:
                raise ValueError(f"the warm-up request to {url} failed: {warm.error}")
        semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(prompt: str) -> RequestResult:
            async with semaphore:
                return await _send(session, url, _payload(args, model, prompt), headers)

        start, tasks = time.perf_counter(), []
        for prompt, delay in zip(prompts[: args.num_prompts], _arrival_gaps(args)):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


async def _first_model(session, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as response:
        if response.status != 200:
            raise ValueError(f"GET {base_url}/v1/models answered {response.status}; is "
                             "the server up (pagedjax serve)?")
        return (await response.json())["data"][0]["id"]


def _arrival_gaps(args: argparse.Namespace) -> list[float]:
    if args.request_rate == float("inf"):
        return [0.0] * args.num_prompts
    rng = np.random.default_rng(args.seed)
    theta = 1.0 / (args.request_rate * args.burstiness)
    return rng.gamma(shape=args.burstiness, scale=theta, size=args.num_prompts).tolist()


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "url": args.url, "endpoint": args.endpoint,
        "model": model, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "input_len_words": args.input_len, "output_len": args.output_len,
        "ignore_eos": args.ignore_eos, "completed": len(done),
        "failed": len(results) - len(done), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "errors": sorted({r.error for r in results if r.error})[:10],
    }
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in done], "tpot": tpots,
              "itl": [x for r in done for x in r.itl], "e2el": [r.e2e for r in done]}
    percentiles = [float(p) for p in args.percentiles.split(",")]
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    for key in ("completed", "failed", "max_concurrency", "duration", "total_input_tokens",
                "total_output_tokens", "request_throughput", "output_throughput",
                "total_token_throughput"):
        value = summary[key]
        print(f"{key:<44}{value:>16.2f}" if isinstance(value, float)
              else f"{key:<44}{value!s:>16}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for key, value in summary.items():
            if key.endswith(f"_{name}_ms") and not key.startswith("std"):
                print(f"{key:<44}{value:>16.2f}")
    for error in summary["errors"]:
        print(f"error: {error}")
    print("=" * 60)


def main(args: argparse.Namespace) -> dict[str, Any]:
    summary = asyncio.run(_run(args))
    print_summary(summary)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main(add_cli_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
