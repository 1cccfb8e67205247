"""`pagedjax::greedy_decode`: single-token greedy passes in one C++ op on the CPU (a draft's
K - 1 passes in backends/torch/spec_step.py, a greedy decode step in backends/torch/step.py). It
must be the model's forward, logits_stats' argmax and the token's logprob, step by step, to the
bit: the same tokens, logprobs and KV cache contents, with a packed head and with a head kept in
int8 blocks, sequences that stop writing (slot -1, position 0) included; and a greedy decode
step through it the same ModelOutput as the general step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedjax import LLM, SamplingParams
from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.torch.sampler import gather_logprobs, logits_stats
from pagedjax.backends.torch.step import StepBody
from tests.backends.test_engine_step import record_steps

BLOCK_SIZE = 16
PROMPT_LENS = (9, 16, 23)  # one sequence a block table row, its blocks its own


def _engine_model(model_dir: str, **kwargs):
    llm = LLM(model_dir, backend="torch", max_model_len=128, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=16, **kwargs)
    return llm, llm.engine.runner.models[0]


def _prefill(model, block_tables: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Each sequence's prompt into the caches → the last prompt token's argmax [S] int32."""
    lens = torch.tensor(PROMPT_LENS, dtype=torch.int32)
    ids = torch.from_numpy(rng.integers(1, model.config.vocab_size, int(lens.sum()))).int()
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in PROMPT_LENS])
    seq = torch.repeat_interleave(torch.arange(len(PROMPT_LENS)), lens)
    slots = block_tables[seq, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    meta = AttentionMetadata(positions, slots.int(), query_start_loc, lens, block_tables,
                             *model.rope, max_query_len=max(PROMPT_LENS))
    logits = model.forward(ids, model.kv_caches, meta, (query_start_loc[1:] - 1).long())
    return logits_stats(logits)[0]


def _steps(num_steps: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions and slot_mapping [J, S] after each prompt; the last sequence stops writing after
    the first step (slot -1, position 0, as a sequence with fewer drafts)."""
    lens = torch.tensor(PROMPT_LENS, dtype=torch.int32)
    positions = lens[None, :] + torch.arange(num_steps, dtype=torch.int32)[:, None]  # [J, S]
    rows = torch.arange(len(PROMPT_LENS))[None, :].expand(num_steps, -1)
    slots = (block_tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE
             + positions % BLOCK_SIZE).int()
    positions[1:, -1], slots[1:, -1] = 0, -1
    return positions.contiguous(), slots.contiguous()


def _loop(model, first: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
          block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the model's forward, argmax and the token's logprob as the sampler
    computes them, one step at a time → tokens [J, S] int32, logprobs [J, S]."""
    num_seqs = first.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    tokens, logprobs = [first], []
    for step_positions, step_slots in zip(positions, slots):
        meta = AttentionMetadata(step_positions, step_slots, query_start_loc, step_positions + 1,
                                 block_tables, *model.rope, max_query_len=1)
        logits = model.forward(tokens[-1], model.kv_caches, meta, torch.arange(num_seqs))
        argmax, lse = logits_stats(logits)
        tokens.append(argmax)
        logprobs.append(gather_logprobs(logits, lse, argmax, 0)[0])
    return torch.stack(tokens[1:]), torch.stack(logprobs)


# a packed head, then one in int8 blocks; q/k/v bias and a tied head; q/k norms and experts
@pytest.mark.parametrize(("arch", "quantization"), [("llama", None), ("llama", "int8"),
                                                    ("qwen2", None), ("qwen3_moe", None)])
def test_greedy_decode_is_the_forward_loop_bit_for_bit(tiny_model, arch, quantization) -> None:
    llm, model = _engine_model(tiny_model(arch), quantization=quantization)
    assert model.module.stack is not None
    assert (model.module.lm_head.qtype is not None) == (quantization is not None)
    block_tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    with torch.inference_mode():
        first = _prefill(model, block_tables, np.random.default_rng(0))
        positions, slots = _steps(4, block_tables)
        before = model.kv_pool.clone()
        expected, expected_logprobs = _loop(model, first, positions, slots, block_tables)
        expected_pool = model.kv_pool.clone()
        model.kv_pool.copy_(before)
        tokens, logprobs = model.greedy_decode(first, positions, slots, block_tables)
    assert tokens.dtype == torch.int32 and tokens.shape == (4, 3)
    assert torch.equal(tokens, expected)
    assert logprobs.dtype == torch.float32 and torch.equal(logprobs, expected_logprobs)
    assert torch.equal(model.kv_pool, expected_pool)
    assert not torch.equal(expected_pool, before)  # the steps wrote their keys and values
    llm.shutdown()


@pytest.mark.parametrize("arch", ["granite", "gemma2"])
def test_greedy_decode_declines_what_it_does_not_compute(tiny_model, arch) -> None:
    """Where the forward has a step the op leaves out (Granite's multipliers, Gemma's offset
    norms and soft cap), the op is not used: the Python loop runs."""
    llm, model = _engine_model(tiny_model(arch))
    args = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
            torch.full((1, 1), -1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))
    assert model.greedy_decode(*args) is None
    llm.shutdown()


def test_a_greedy_decode_step_is_the_general_step(tiny_model, monkeypatch) -> None:
    """Greedy decode steps (rows that ask for nothing else) run as one op: the same tokens and
    logprobs as the general step, step by step; a step whose rows ask for logprobs, or that
    samples, keeps the general path."""
    prompts = [{"prompt_token_ids": list(range(5 + 7 * i, 30 + 11 * i))} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    taken = []
    fast = StepBody.greedy_decode_step

    def counted(self, *args):
        out = fast(self, *args)
        taken.append(out is not None)
        return out

    runs = []
    for step in (counted, lambda self, *args: None):  # the op, then the general path
        monkeypatch.setattr(StepBody, "greedy_decode_step", step)
        llm, _ = _engine_model(tiny_model("qwen2"), max_num_seqs=4)
        steps = record_steps(llm)
        llm.generate(prompts, greedy, use_tqdm=False)
        runs.append([out for model_input, out in steps if model_input.layout.decode])
        if step is counted:  # logprobs asked, or sampled rows: no call
            num_taken = len(taken)
            for params in (SamplingParams(temperature=0.0, max_tokens=4, logprobs=1),
                           SamplingParams(temperature=0.8, max_tokens=4, seed=0)):
                llm.generate(prompts, params, use_tqdm=False)
            assert len(taken) == num_taken
        llm.shutdown()
    assert taken and all(taken) and len(taken) == len(runs[0])  # every greedy decode step
    for fast_out, general_out in zip(*runs, strict=True):
        assert np.array_equal(fast_out.sampled_token_ids, general_out.sampled_token_ids)
        assert np.array_equal(fast_out.sampled_logprobs, general_out.sampled_logprobs)
