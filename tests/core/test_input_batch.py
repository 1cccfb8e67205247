"""The persistent batch equals a rebuild: after every step of a random workload (adds, aborts,
preemptions, prefix hits, n > 1, beams, speculation, structured outputs, penalties, prompt
logprobs, stop strings), the step's ModelInput equals the reference builder's from scratch
(build_model_input over `describe`), and every row equals one filled anew from its sequence.
The scheduler's bulk decode path schedules what its per-sequence path does.

The engine runs the fixed-token runner (no model): these are the core's bookkeeping only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.core.batch import ModelInput
from pagedjax.core.batch_reference import build_model_input, describe
from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.core.fixed_token_runner import fixed_tokens
from pagedjax.core.input_batch import InputBatch
from pagedjax.model_loader.demo import demo_model_dirs
from pagedjax.sampling_params import StructuredOutputsParams

ROW_ARRAYS = ("num_prompt_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "filters", "logprobs",
              "prompt_logprobs", "rng_seed", "rng_offset", "has_entries", "appends_sampled")


def assert_same_input(got: ModelInput, want: ModelInput) -> None:
    assert got.layout == want.layout and got.flags == want.flags
    np.testing.assert_array_equal(got.ints, want.ints)
    np.testing.assert_array_equal(got.floats, want.floats)
    np.testing.assert_array_equal(got.block_copies, want.block_copies)
    for name in ("seq_ids", "num_tokens", "num_seqs", "max_query_len", "max_draft_query_len",
                 "num_spec_tokens", "num_draft_tokens", "prompt_logprobs_rows"):
        assert getattr(got, name) == getattr(want, name), name
    assert (got.entries is None) == (want.entries is None)
    if got.entries is not None:
        assert got.entries.num_entries == want.entries.num_entries
        np.testing.assert_array_equal(got.entries.ints, want.entries.ints)
        np.testing.assert_array_equal(got.entries.bias, want.entries.bias)


def assert_rows_rebuilt(batch: InputBatch, engine) -> None:
    """Each row equals a row filled anew from its sequence and its block table."""
    fresh = InputBatch(engine.shapes, block_size=engine.config.block_size,
                       max_model_len=engine.config.max_model_len,
                       eos_token_ids=engine.eos_token_ids)
    tables = engine.block_manager.tables
    for seq_id, row in batch.row_of.items():
        seq = engine.scheduler.seqs[seq_id]
        assert not seq.is_finished and batch.seqs[row] is seq
        new = fresh.add(seq, tables[seq_id])
        n = seq.num_tokens
        assert batch.num_tokens[row] == n, seq_id
        np.testing.assert_array_equal(batch.token_ids[row, :n], fresh.token_ids[new, :n])
        np.testing.assert_array_equal(batch.block_table[row], fresh.block_table[new])
        assert batch.num_blocks[row] == fresh.num_blocks[new]
        for name in ROW_ARRAYS:
            assert getattr(batch, name)[row] == getattr(fresh, name)[new], (name, seq_id)
        fresh.remove(seq_id)


def checked(engine) -> list[int]:
    """Check every step the engine prepares; returns a list counting them."""
    prepare, count = engine.engine_core._prepare, []

    def checked_prepare(out):
        model_input = prepare(out)
        seqs = engine.scheduler.seqs
        want = build_model_input(describe(out, seqs, engine.block_manager, engine.eos_token_ids),
                                 engine.shapes, block_size=engine.config.block_size)
        assert_same_input(model_input, want)
        assert_rows_rebuilt(engine.engine_core.input_batch, engine)
        count.append(len(out.seq_ids))
        return model_input

    engine.engine_core._prepare = checked_prepare
    return count


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams | BeamSearchParams:
    kind = rng.integers(10)
    max_tokens = int(rng.integers(1, 24))
    if kind == 0:
        return BeamSearchParams(beam_width=int(rng.integers(2, 4)), max_tokens=max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=float(rng.choice([0.0, 0.8])),
                            seed=int(rng.integers(1 << 30)))
    if kind == 1:
        params.n = int(rng.integers(2, 4))
    elif kind == 2:
        params.presence_penalty, params.repetition_penalty = 0.5, 1.3
    elif kind == 3:
        params.logit_bias = {int(rng.integers(vocab)): 2.0}
        params.min_tokens = min(3, max_tokens)
    elif kind == 4:
        params.prompt_logprobs, params.logprobs = 2, 3
    elif kind == 5:
        params.top_k, params.top_p = 5, 0.9
    elif kind == 6:
        params.structured_outputs = StructuredOutputsParams(regex=r"[a-z ]{1,12}")
    elif kind == 7:
        params.stop = ["e"]
    return dataclasses.replace(params)  # validated again


def run_workload(llm: LLM, seed: int, num_requests: int = 40, echo: bool = False) -> None:
    """echo: some prompts end in a copy of the tokens the fixed-token runner will generate for
    them, so that n-gram drafts are found and accepted."""
    engine, rng = llm.engine, np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    shared = rng.integers(1, vocab, 48).tolist()  # a prefix some prompts share: cache hits
    live: list[str] = []
    for i in range(num_requests):
        prompt = rng.integers(1, vocab, int(rng.integers(2, 40))).tolist()
        if rng.random() < 0.4:
            prompt = shared[: int(rng.integers(17, 48))] + prompt
        if echo and rng.random() < 0.5:  # the output at positions L, L + 1, ...: copied
            copied = int(rng.integers(4, 16))
            length = len(prompt) + copied
            prompt += fixed_tokens(np.arange(length - 1, length - 1 + copied), vocab).tolist()
        params = random_params(rng, vocab)
        request_id = f"r{i}"
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        live.append(request_id)
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
        if rng.random() < 0.15:
            engine.abort_request(live.pop(int(rng.integers(len(live)))))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("speculative", [None, "draft_model", "ngram", "suffix"])
def test_the_persistent_batch_equals_a_rebuild_after_every_step(speculative: str | None
                                                                  ) -> None:
    target, draft = demo_model_dirs()
    spec = {"draft_model": {"model": draft, "num_speculative_tokens": 3},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 3, "adaptive": False},
            "suffix": {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False},
            None: None}[speculative]
    # a pool of 24 blocks of 8 tokens for up to 8 sequences: preemptions
    llm = LLM(target, backend="fixed-tokens", max_model_len=128, block_size=8,
              num_gpu_blocks_override=24, max_num_seqs=8, max_num_batched_tokens=64,
              speculative_config=spec)
    steps = checked(llm.engine)
    run_workload(llm, seed=3 if speculative else 1, echo=speculative in ("ngram", "suffix"))
    metrics = llm.get_metrics()
    assert len(steps) > 60
    assert metrics["num_preemptions_total"] > 0 and metrics["prefix_cache_hits"] > 0
    assert metrics["structured_output_requests_total"] > 0
    if speculative:
        assert metrics["spec_decode_num_draft_tokens"] > 0
    if speculative in ("ngram", "suffix"):  # found in the copies, and kept
        assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics[
            "spec_decode_num_draft_tokens"]
    assert llm.engine.engine_core.input_batch.num_rows == 0  # every row freed
    assert llm.engine.block_manager.num_free_blocks == 24
    llm.shutdown()


def test_async_scheduling_steps_equal_a_rebuild(monkeypatch) -> None:
    """Steps scheduled before the last one's tokens reach the host (their inputs read on the
    device) build the same inputs as the reference, rows included."""
    from pagedjax.core.fixed_token_runner import FixedTokenRunner

    monkeypatch.setattr(FixedTokenRunner, "async_launch", True)
    llm = LLM(demo_model_dirs()[0], backend="fixed-tokens", max_model_len=128, max_num_seqs=8,
              async_scheduling=True)
    steps = checked(llm.engine)
    ahead = []
    schedule_next = llm.engine.scheduler.schedule_next


    def counted(last):
        out = schedule_next(last)
        ahead.append(out is not None)
        return out

    llm.engine.scheduler.schedule_next = counted
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20)
    llm.generate([{"prompt_token_ids": list(range(1, 4 + i))} for i in range(6)], params)
    assert sum(ahead) > 10 and len(steps) >= 20
    llm.shutdown()


@pytest.mark.parametrize("speculative", [None, "draft_model"])
def test_the_bulk_decode_path_schedules_what_the_per_sequence_path_does(speculative) -> None:
    """Scheduler._schedule_decodes (every running sequence decodes one token; with a draft
    model, at k = 0 while nothing waits) against _schedule_running alone: the same steps, block
    tables and tokens, through adds, aborts, preemptions and prefix hits; with a draft model
    every seventh step drafts k = 2 (scripted: the policy's choice hangs on step times)."""
    target, draft = demo_model_dirs()
    spec = {"model": draft, "num_speculative_tokens": 2} if speculative else None

    def run(bulk: bool) -> tuple[list, dict, int]:
        llm = LLM(target, backend="fixed-tokens", max_model_len=128, block_size=8,
                  num_gpu_blocks_override=24, max_num_seqs=8, max_num_batched_tokens=64,
                  speculative_config=spec)
        core, engine, steps, bulk_steps = llm.engine.engine_core, llm.engine, [], []
        schedule_decodes = core.scheduler._schedule_decodes

        def counted(step) -> bool:
            taken = bulk and schedule_decodes(step)
            bulk_steps.extend([1] * taken)
            return taken

        core.scheduler._schedule_decodes = counted
        if speculative:
            count = iter(range(10**6))
            core._choose_num_spec_tokens = lambda: 2 if next(count) % 7 == 6 else 0
        prepare = core._prepare

        def recorded(out):
            steps.append((out.seq_ids, out.num_computed_tokens, out.num_new_tokens,
                          out.num_spec_tokens_per_seq, out.draft_start_pos,
                          out.num_draft_tokens, out.block_copies, out.removed_seq_ids,
                          dict(out.block_table_changes)))
            return prepare(out)

        core._prepare = recorded
        rng, vocab = np.random.default_rng(7), engine.model_config.vocab_size
        shared = rng.integers(1, vocab, 24).tolist()
        for i in range(24):
            prompt = rng.integers(1, vocab, int(rng.integers(2, 30))).tolist()
            if rng.random() < 0.4:
                prompt = shared + prompt
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(
                max_tokens=int(rng.integers(4, 40)), temperature=0.8, seed=i))
            for _ in range(int(rng.integers(0, 5))):
                engine.step()
            if rng.random() < 0.1:
                engine.abort_request(f"r{int(rng.integers(i + 1))}")
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
        assert engine.get_metrics()["num_preemptions_total"] > 0
        llm.shutdown()
        return steps, outputs, len(bulk_steps)

    bulk_run, per_sequence_run = run(True), run(False)
    assert bulk_run[2] > 20 and per_sequence_run[2] == 0  # steps the bulk path took
    assert bulk_run[:2] == per_sequence_run[:2]
