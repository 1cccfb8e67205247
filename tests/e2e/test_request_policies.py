"""Request policies end to end on both backends: n > 1 samples share the prompt's blocks, beam
search equals HF's generate(num_beams=W) and shares blocks, and a prefix-cache hit computes only
the suffix."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, BeamSearchParams, SamplingParams
from pagedjax.core.block_manager import BlockManager, CopyingBlockManager
from pagedjax.core.scheduler_output import SchedulerOutput
from pagedjax.rng import derive_seed
from tests.support.hf_reference import hf_beam_search, hf_greedy

BACKENDS = ["jax", "torch"]
PROMPT_40 = list(range(1, 41))  # two full blocks of 16, and 8 tokens in a third


def make_llm(model_dir: str, backend: str, **kwargs) -> LLM:
    kwargs = dict(dict(max_model_len=256, num_gpu_blocks_override=128), **kwargs)
    return LLM(model_dir, backend=backend, **kwargs)


def record_schedule(llm: LLM) -> list[tuple[SchedulerOutput, list[str]]]:
    """Each step's SchedulerOutput, with the request id of each scheduled sequence."""
    scheduler, log = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        log.append((out, [scheduler.seqs[seq_id].request_id for seq_id in out.seq_ids]))
        return out

    scheduler.schedule = recording_schedule
    return log


def used_blocks(llm: LLM) -> int:
    bm = llm.engine.block_manager
    return bm.num_blocks - bm.num_free_blocks


def run_to_end(llm: LLM) -> dict:
    finished = {}
    while llm.engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    return finished


def assert_no_leaks(llm: LLM) -> None:
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    assert not llm.engine.scheduler.seqs and not llm.engine.engine_core.policies


# ---- parallel sampling -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_four_samples_hold_the_prompt_once_and_copy_the_shared_partial_block(tiny_model,
                                                                              backend) -> None:
    model_dir = tiny_model("llama")
    llm = make_llm(model_dir, backend)
    engine, bm, log = llm.engine, llm.engine.block_manager, record_schedule(llm)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": PROMPT_40}, params)
    engine.step()  # the prompt, and four first tokens from its last position
    seqs = sorted(engine.scheduler.running, key=lambda s: s.index)
    prompt_table = list(bm.get_block_table(seqs[0].seq_id))
    assert len(seqs) == 4 and len(prompt_table) == 3
    assert all(bm.get_block_table(s.seq_id) == prompt_table for s in seqs)
    assert [bm.ref_count(b) for b in prompt_table] == [4, 4, 4] and used_blocks(llm) == 3

    engine.step()  # each sample writes position 40: the shared partial block is copied 3 times
    assert [src for src, _ in log[-1][0].block_copies] == [prompt_table[2]] * 3
    tables = [bm.get_block_table(s.seq_id) for s in seqs]
    assert all(t[:2] == prompt_table[:2] for t in tables) and len({t[2] for t in tables}) == 4
    assert used_blocks(llm) == 2 + 4

    peak, outputs = used_blocks(llm), {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        peak = max(peak, used_blocks(llm))
    # 59 computed positions: the 2 full prompt blocks once, then 2 blocks per sample (not 4 x 4).
    assert peak == 2 + 4 * 2
    greedy = hf_greedy(model_dir, [PROMPT_40], 20)[0]
    assert [c.token_ids for c in outputs["r"].outputs] == [greedy] * 4
    assert_no_leaks(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_samples_equal_their_streams_run_as_separate_requests(tiny_model,
                                                                     backend) -> None:
    llm = make_llm(tiny_model("llama"), backend)
    params = SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    together = llm.generate({"prompt_token_ids": PROMPT_40}, params, use_tqdm=False)[0]
    engine = llm.engine
    alone = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"alone-{i}", {"prompt_token_ids": PROMPT_40}, alone)
    engine._drain_inbox()  # the requests reach the scheduler: give each completion i's stream
    engine.engine_core._apply_pending()
    for i, seq in enumerate(engine.scheduler.waiting):
        seq.rng_seed = derive_seed(7, i)
    outputs = run_to_end(llm)
    samples = [c.token_ids for c in together.outputs]
    assert samples == [outputs[f"alone-{i}"].outputs[0].token_ids for i in range(4)]
    assert len({tuple(s) for s in samples}) > 1
    assert_no_leaks(llm)


# ---- beam search -------------------------------------------------------------------------------

MAX_TOKENS = 12
# (beam_width, length_penalty, early_stopping): width 1 is HF's greedy search.
BEAM_GRID = [(w, lp, es) for w in (2, 4) for lp in (0.5, 1.0, 2.0)
             for es in (False, True, "never")] + [(1, 1.0, False)]


def beam_prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, vocab_size, n).tolist() for n in (3, 17, 30)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_eos", [False, True], ids=["ignore_eos", "eos"])
def test_beam_search_equals_hf_batched_with_other_requests(tiny_model, eos_model, backend,
                                                           with_eos) -> None:
    """Every grid point on every prompt, and a greedy request, in one engine run: the beams of
    57 requests (widths summing to 111, over max_num_seqs=32) and the greedy one share steps."""
    model_dir = eos_model if with_eos else tiny_model("llama")
    eos = 0 if with_eos else None
    llm = make_llm(model_dir, backend, max_num_seqs=32)
    engine, log = llm.engine, record_schedule(llm)
    prompts = beam_prompts(engine.model_config.vocab_size)
    requests = {}
    for g, (width, lp, es) in enumerate(BEAM_GRID):
        for p, prompt in enumerate(prompts):
            requests[f"beam-{g}-{p}"] = (width, lp, es, prompt)
            params = BeamSearchParams(width, MAX_TOKENS, ignore_eos=not with_eos,
                                      length_penalty=lp, early_stopping=es)
            engine.add_request(f"beam-{g}-{p}", {"prompt_token_ids": prompt}, params)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=not with_eos)
    engine.add_request("greedy", {"prompt_token_ids": prompts[2]}, greedy)
    outputs = run_to_end(llm)

    for request_id, (width, lp, es, prompt) in requests.items():
        want = hf_beam_search(model_dir, prompt, width, MAX_TOKENS, lp, es, eos)
        got = outputs[request_id].outputs
        assert [c.token_ids for c in got] == [ids for ids, _ in want], (request_id, width, lp, es)
        if width > 1:
            scores = [c.cumulative_logprob / len(c.token_ids) ** lp for c in got]
            np.testing.assert_allclose(scores, [s for _, s in want], rtol=1e-4)
        ends = ["stop" if with_eos and c.token_ids[-1] == eos else "length" for c in got]
        assert [c.finish_reason for c in got] == ends
    greedy_beam = outputs[f"beam-{len(BEAM_GRID) - 1}-2"].outputs[0]
    assert greedy_beam.token_ids == outputs["greedy"].outputs[0].token_ids  # width 1 is greedy
    # The greedy request ran in the same steps as several beam requests.
    assert max(len(set(ids)) for _, ids in log if "greedy" in ids) >= 3
    assert_no_leaks(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_beams_share_blocks(tiny_model, backend) -> None:
    llm = make_llm(tiny_model("llama"), backend)
    engine, bm, log = llm.engine, llm.engine.block_manager, record_schedule(llm)
    params = BeamSearchParams(4, 20, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": PROMPT_40}, params)
    engine.step()  # the prompt; the 4 best first tokens all continue its one sequence
    beams = engine.engine_core.policies["r"].beams
    prompt_table = list(bm.get_block_table(beams[0].seq.seq_id))
    assert len(beams) == 4 and len(prompt_table) == 3 and used_blocks(llm) == 3
    assert all(bm.get_block_table(b.seq.seq_id) == prompt_table for b in beams)
    assert [bm.ref_count(b) for b in prompt_table] == [4, 4, 4]

    engine.step()  # each beam writes position 40 into the shared partial block: 3 copies
    assert [src for src, _ in log[-1][0].block_copies] == [prompt_table[2]] * 3
    policies, outputs = engine.engine_core.policies, []
    while "r" in policies:  # the search runs (its output may come a step after it ends)
        tables = [bm.get_block_table(b.seq.seq_id) for b in policies["r"].beams]
        # Every beam holds the full prompt blocks, and the pool holds each distinct block once
        # (a beam's fork shares its parent's; a dropped beam's unshared ones went back).
        assert len(tables) == 4 and all(t[:2] == prompt_table[:2] for t in tables)
        assert used_blocks(llm) == len({b for t in tables for b in t})
        outputs += engine.step()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].outputs) == 4
    assert_no_leaks(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_beams_never_draft_beside_requests_that_do(tiny_model, backend) -> None:
    """With a draft model, beams get no draft slots (their policy picks one token a step) and
    equal an engine's without one; a greedy request in the same steps drafts."""
    speculative_config = {"model": tiny_model("draft"), "num_speculative_tokens": 3,
                          "adaptive": False}

    def run(**kwargs) -> tuple[dict, list, LLM]:
        llm = make_llm(tiny_model("llama"), backend, **kwargs)
        log = record_schedule(llm)
        llm.engine.add_request("beams", {"prompt_token_ids": PROMPT_40},
                               BeamSearchParams(3, 10, ignore_eos=True))
        llm.engine.add_request("greedy", {"prompt_token_ids": PROMPT_40[:21]},
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        outputs = run_to_end(llm)
        return {k: [c.token_ids for c in o.outputs] for k, o in outputs.items()}, log, llm

    plain, _, _ = run()
    drafted, log, llm = run(speculative_config=speculative_config)
    assert drafted == plain
    drafting = {request_id for out, ids in log
                for num_spec, num_draft, request_id in zip(out.num_spec_tokens_per_seq,
                                                           out.num_draft_tokens, ids)
                if num_spec or num_draft}
    assert drafting == {"greedy"}
    assert_no_leaks(llm)


def test_bad_beam_search_values(tiny_model) -> None:
    llm = make_llm(tiny_model("llama"), "torch", max_num_seqs=8)
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(0, 8)
    with pytest.raises(ValueError, match="max_tokens=0"):
        BeamSearchParams(2, 0)
    with pytest.raises(ValueError, match="temperature=0.7"):
        BeamSearchParams(2, 8, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping='always'"):
        BeamSearchParams(2, 8, early_stopping="always")
    with pytest.raises(ValueError, match="beam_width=9 exceeds max_num_seqs=8"):
        llm.beam_search(["x = 1"], BeamSearchParams(9, 8))
    with pytest.raises(ValueError, match="beam_width=11 needs the top 22 logprobs"):
        LLM(tiny_model("llama"), backend="torch", max_model_len=256,
            num_gpu_blocks_override=64).beam_search(["x"], BeamSearchParams(11, 8))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.beam_search(["x = 1"], BeamSearchParams(2, 300))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["x = 1"], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_beam_search_api_shapes(tiny_model) -> None:
    """vLLM's shapes: tokens include the prompt, text is the generated text, best first."""
    llm = make_llm(tiny_model("llama"), "torch")
    tokenizer = llm.get_tokenizer()
    prompt = "def main(argv):"
    outs = llm.beam_search([prompt, {"prompt": prompt}, {"prompt_token_ids":
                                                          tokenizer.encode(prompt)}],
                           BeamSearchParams(3, 6, ignore_eos=True))
    assert len(outs) == 3 and all(len(o.sequences) == 3 for o in outs)
    assert outs[0] == outs[1] == outs[2]
    prompt_ids = tokenizer.encode(prompt)
    for seq in outs[0].sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids and len(seq.tokens) == len(
            prompt_ids) + 6
        assert seq.text == tokenizer.decode(seq.tokens[len(prompt_ids):],
                                            skip_special_tokens=True)
        assert seq.cum_logprob == pytest.approx(
            sum(lp.logprob for entry in seq.logprobs for lp in entry.values()), rel=1e-5)
    scores = [s.cum_logprob / 6 for s in outs[0].sequences]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_no_sharing_baseline_generates_the_same_in_more_blocks(tiny_model, backend) -> None:
    """benchmarks/memory.py's baseline (forks copy every block) changes memory, not tokens."""
    prompts = {"samples": SamplingParams(n=4, temperature=0.9, seed=3, max_tokens=16,
                                         ignore_eos=True),
               "beams": BeamSearchParams(4, 16, ignore_eos=True)}

    def run(block_manager_cls) -> tuple[dict, int]:
        llm = make_llm(tiny_model("llama"), backend, enable_prefix_caching=False)
        engine = llm.engine
        bm = block_manager_cls(engine.block_manager.num_blocks, engine.block_manager.block_size)
        engine.block_manager = engine.scheduler.block_manager = bm
        engine.engine_core.block_manager = bm
        for request_id, params in prompts.items():
            engine.add_request(request_id, {"prompt_token_ids": PROMPT_40}, params)
        outputs, peak = {}, 0
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, [c.token_ids for c in o.outputs])
                           for o in engine.step())
            peak = max(peak, used_blocks(llm))
        assert_no_leaks(llm)
        return outputs, peak

    shared, shared_peak = run(BlockManager)
    copied, copied_peak = run(CopyingBlockManager)
    assert copied == shared and len({tuple(s) for s in shared["samples"]}) > 1
    assert copied_peak > shared_peak


# ---- prefix caching ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_200_token_prefix_is_computed_once(tiny_model, backend) -> None:
    model_dir = tiny_model("llama")
    rng = np.random.default_rng(5)
    prefix = rng.integers(1, 512, 200).tolist()  # 25 full blocks of 8
    first, second = (prefix + rng.integers(1, 512, 7).tolist(),
                     prefix + rng.integers(1, 512, 11).tolist())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(model_dir, backend, block_size=8, max_num_batched_tokens=1024)
    log = record_schedule(llm)
    llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    num_steps = len(log)
    out = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    admitted = log[num_steps][0]
    # only the suffix
    assert (admitted.num_computed_tokens[0], admitted.num_new_tokens[0]) == (200, 11)
    assert out.num_cached_tokens == 200
    uncached = make_llm(model_dir, backend, block_size=8, enable_prefix_caching=False)
    want = uncached.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert want.num_cached_tokens == 0
