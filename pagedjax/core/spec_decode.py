"""Speculative decoding: its configuration, its metrics, and how many drafts to propose.

Draft and target share one BlockManager and one block table per sequence; the runner keeps a KV
cache per model indexed by the same block ids and runs the whole speculative step on the device
(draft catch-up, k draft steps, one ragged target pass over k + 1 positions per sequence, exact
rejection sampling). The core only reserves draft slots and rolls back rejected ones.

How many drafts each step proposes is the policy's (spec_policy.py); this file measures the
startup table that seeds it (measure_step_costs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch import ModelInput
from pagedjax.core.batch_reference import build_model_input
from pagedjax.core.scheduler_output import (
    SampledTokens,
    SampleSpec,
    ScheduledBatch,
    ScheduledSequence,
    SchedulerOutput,
)
from pagedjax.core.step_shapes import StepShapes
from pagedjax.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
_KEYS = ("model", "num_speculative_tokens", "method", "adaptive", "draft_tensor_parallel_size",
         "prompt_lookup_min", "prompt_lookup_max", *_SUFFIX_KEYS)
_METHODS = ("draft_model", "ngram", "suffix")
# methods whose drafts the host proposes (no draft model, no draft KV): host_drafts.py
HOST_METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """speculative_config, validated: what the engine and the runners read (EngineConfig
    holds the user's dict until the engine replaces it with this)."""

    model: str | None  # draft checkpoint directory (method "draft_model"; else None)
    num_speculative_tokens: int  # k: the most drafts proposed per sequence and step
    adaptive: bool = True  # pick k per step from measurements; False: always k
    # 1: the draft on every device whole; or the target's tensor_parallel_size: split
    draft_tensor_parallel_size: int = 1
    method: str = "draft_model"  # or a host method: "ngram" (prompt lookup), "suffix"
    prompt_lookup_min: int = 2  # ngram: the shortest n-gram matched
    prompt_lookup_max: int = 5  # ngram: the longest
    # suffix decoding (suffix_proposer.py), vLLM's names and defaults
    suffix_decoding_max_tree_depth: int = 24  # the longest substring the trees count
    suffix_decoding_max_cached_requests: int = 10000  # finished outputs the global tree holds
    suffix_decoding_max_spec_factor: float = 1.0  # drafts <= factor * match length
    suffix_decoding_min_token_prob: float = 0.1  # a draft token's least estimated probability

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, config: dict | SpeculativeConfig,
                  tensor_parallel_size: int = 1) -> SpeculativeConfig:
        if isinstance(config, SpeculativeConfig):
            return config
        unknown = set(config) - set(_KEYS)
        method = config.get("method", "draft_model" if "model" in config else None)
        if unknown or method is None:
            raise ValueError(f"speculative_config={config!r}: expected the keys {_KEYS} "
                             "with 'model' (a draft checkpoint directory) or a 'method' "
                             f"among {_METHODS}.")
        if method not in _METHODS:
            raise ValueError(f"speculative_config method={method!r} is not supported; use one of "
                             f"{_METHODS}.")
        if method in HOST_METHODS:
            return cls._host_method(config, method)
        if "model" not in config:
            raise ValueError(f"speculative_config method={method!r} needs 'model' (a draft "
                             "checkpoint directory).")
        k = _num_speculative_tokens(config)
        draft_tp = config.get("draft_tensor_parallel_size", tensor_parallel_size)
        if draft_tp not in (1, tensor_parallel_size):
            raise ValueError(f"speculative_config draft_tensor_parallel_size={draft_tp!r} must be "
                             f"1 (the draft replicated on every device) or the target's "
                             f"tensor_parallel_size={tensor_parallel_size} (the draft split).")
        adaptive = _adaptive(config)
        if not (Path(config["model"]) / "config.json").is_file():
            raise ValueError(f"speculative model={config['model']!r} is not a Hugging Face "
                             "checkpoint directory (no config.json).")
        return cls(str(config["model"]), k, adaptive, draft_tp)

    @classmethod
    def _host_method(cls, config: dict, method: str) -> SpeculativeConfig:
        """ngram and suffix: vLLM's keys; one of prompt_lookup_min / max alone sets both."""
        if config.get("model") is not None:
            raise ValueError(f"speculative_config method={method!r} uses no draft model; drop "
                             f"'model'={config['model']!r}.")
        foreign = set(config) & set(_SUFFIX_KEYS if method == "ngram" else
                                    ("prompt_lookup_min", "prompt_lookup_max"))
        if foreign:
            raise ValueError(f"speculative_config keys {sorted(foreign)} do not apply to "
                             f"method={method!r}.")
        if method == "suffix":
            return cls._suffix(config)
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if low is None and high is None:
            low, high = cls.prompt_lookup_min, cls.prompt_lookup_max
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an integer "
                                 ">= 1.")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds "
                             f"prompt_lookup_max={high}.")
        return cls(None, _num_speculative_tokens(config), _adaptive(config), 1, method, low,
                   high)

    @classmethod
    def _suffix(cls, config: dict) -> SpeculativeConfig:
        values = {key: config.get(key, getattr(cls, key)) for key in _SUFFIX_KEYS}
        depth, cached, factor, prob = values.values()
        checks = (("suffix_decoding_max_tree_depth", depth, _is_int(depth) and depth >= 1,
                   "an integer >= 1"),
                  ("suffix_decoding_max_cached_requests", cached, _is_int(cached) and cached >= 0,
                   "an integer >= 0"),
                  ("suffix_decoding_max_spec_factor", factor, _is_number(factor) and factor > 0,
                   "a number > 0"),
                  ("suffix_decoding_min_token_prob", prob,
                   _is_number(prob) and 0 <= prob <= 1, "a number in [0, 1]"))
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"speculative_config {name}={value!r} must be {want}.")
        return cls(None, _num_speculative_tokens(config), _adaptive(config), 1, "suffix",
                   suffix_decoding_max_tree_depth=depth,
                   suffix_decoding_max_cached_requests=cached,
                   suffix_decoding_max_spec_factor=float(factor),
                   suffix_decoding_min_token_prob=float(prob))

    def draft_model_config(self, target_dir: str, target_tokenizer: Any,
                           target_config: ModelConfig, max_model_len: int) -> ModelConfig:
        """The draft's ModelConfig, once it is checked against the target's vocabulary and
        max_model_len."""
        from pagedjax.model_loader.tokenizer import load_tokenizer

        draft_config = ModelConfig.from_pretrained(self.model)
        self.check_vocabulary(target_dir, target_tokenizer, load_tokenizer(self.model),
                              target_config.vocab_size, draft_config.vocab_size)
        if draft_config.max_position_embeddings < max_model_len:
            raise ValueError(f"draft max_position_embeddings="
                             f"{draft_config.max_position_embeddings} is below "
                             f"max_model_len={max_model_len}; lower max_model_len.")
        return draft_config

    def check_vocabulary(self, target_dir: str, target_tokenizer: Any, draft_tokenizer: Any,
                         target_vocab_size: int, draft_vocab_size: int) -> None:
        """The draft must speak the target's vocabulary: same size and same token strings."""
        same_size = target_vocab_size == draft_vocab_size
        same_tokens = (target_tokenizer is None or draft_tokenizer is None
                       or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab())
        if not (same_size and same_tokens):
            raise ValueError(
                f"draft {self.model!r} (vocab_size {draft_vocab_size}) does not share the "
                f"target {target_dir!r}'s tokenizer vocabulary (vocab_size {target_vocab_size}"
                f"{'' if same_tokens else ', different tokens'}); use a draft trained with the "
                "target's tokenizer.")


def _num_speculative_tokens(config: dict) -> int:
    k = config.get("num_speculative_tokens", 4)
    if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens={k!r} must be an integer in "
                         f"[1, {MAX_SPECULATIVE_TOKENS}].")
    return k


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _adaptive(config: dict) -> bool:
    adaptive = config.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config adaptive={adaptive!r} must be True or False.")
    return adaptive


def read_vocab_size(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def verified_drafts(out: SchedulerOutput, sampled: SampledTokens) -> list[tuple[int, int]]:
    """(drafts proposed, drafts accepted) of each sequence that drafted this step."""
    if not any(out.num_spec_tokens_per_seq):
        return []
    kept = dict(zip(sampled.seq_ids, sampled.counts().tolist()))
    return [(num_spec, kept[seq_id] - 1)
            for seq_id, num_spec in zip(out.seq_ids, out.num_spec_tokens_per_seq)
            if num_spec and seq_id in kept]


class SpecDecodeMetrics:
    """Draft tokens proposed and accepted, in total and per draft position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts_per_pos = [0] * num_speculative_tokens
        self.num_accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.num_drafts_per_pos[j] += 1
            self.num_accepted_per_pos[j] += j < num_accepted

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            # verifications that carried at least one draft
            "spec_decode_num_verifications": self.num_drafts_per_pos[0],
            # position j: the share of verifications with > j drafts whose first j + 1 were kept
            "spec_decode_acceptance_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.num_accepted_per_pos, self.num_drafts_per_pos)],
        }


# batch bucket → k → seconds of one speculative decode step (k = 0: a plain decode step)
StepCosts = dict[int, dict[int, float]]


def decode_step_inputs(shapes: StepShapes, config: EngineConfig, num_kv_blocks: int
                       ) -> Iterator[tuple[int, int, ModelInput]]:
    """(batch bucket, k, input) of one decode step of each bucket with each compiled k (and
    k = 0), in the steady state of speculative decoding: every sequence has one new token, k
    draft slots and one token for the draft to catch up on, at a context of min(256,
    max_model_len / 2). The steps write KV only into the pool's blocks, which hold nothing
    before the first request."""
    block_size = config.block_size
    context = min(256, config.max_model_len // 2)
    for num_seqs in shapes.seq_buckets:
        for k in (0, *shapes.spec_ks):
            blocks = -(-(context + k + 1) // block_size)
            scheduled = [ScheduledSequence(
                seq_id=s, token_ids=[1], start_pos=context,
                block_table=[(s * blocks + b) % num_kv_blocks for b in range(blocks)],
                samples=[SampleSpec(s, _GREEDY, 0, 0, [])], num_spec_tokens=k,
                draft_start_pos=context, draft_token_ids=[1] if k else [])
                for s in range(num_seqs)]
            out = ScheduledBatch(scheduled, [], k)
            yield num_seqs, k, build_model_input(out, shapes, block_size=block_size)


def measure_step_costs(execute: Callable[[ModelInput], Any], shapes: StepShapes,
                       config: EngineConfig, num_kv_blocks: int, *,
                       repeats: int = 3) -> StepCosts:
    """Time one decode step of each batch bucket with each compiled k (and k = 0) on
    decode_step_inputs: the best of `repeats` runs after one warm-up. Before the first
    request."""
    costs: StepCosts = {}
    for num_seqs, k, model_input in decode_step_inputs(shapes, config, num_kv_blocks):
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            execute(model_input)
            seconds.append(time.perf_counter() - start)
        costs.setdefault(num_seqs, {})[k] = min(seconds[1:])
    return costs


def warm_up_decode_steps(execute: Callable[[ModelInput], Any], shapes: StepShapes,
                         config: EngineConfig, num_kv_blocks: int) -> None:
    """Run each of decode_step_inputs once, before the first request: a compiled step's first
    run in a process is up to twice as slow as the next (the demo pair on jax, a CPU: 16-19
    against 8-10 ms at batch 1, k = 4), and the policy timed it as a step (RESULTS.md, stop
    72)."""
    for _, _, model_input in decode_step_inputs(shapes, config, num_kv_blocks):
        execute(model_input)
