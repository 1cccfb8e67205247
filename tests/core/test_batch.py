"""The packed batch: exact field contents for a hand-made step, layouts, and the output rows."""

from __future__ import annotations

import numpy as np

from pagedjax.core.batch import BatchLayout, ModelOutput, build_model_input
from pagedjax.core.scheduler_output import SampleSpec, ScheduledSequence, SchedulerOutput
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0)


def spec(seq_id: int, params: SamplingParams = GREEDY, step: int = 0,
         banned: list[int] | None = None) -> SampleSpec:
    return SampleSpec(seq_id, params, rng_seed=0xFFFFFFF0 + seq_id, rng_step=step,
                      banned_token_ids=banned or [])


def test_mixed_step_with_drafts() -> None:
    """Seq 0 decodes with 2 draft slots (its draft catches up on 2 tokens); seq 1 is a prefill
    chunk (no sample, partial draft catch-up); seq 2 finishes its prompt and forks seq 3."""
    sampled = SamplingParams(temperature=0.7, top_k=5, logprobs=2)
    entries = [
        ScheduledSequence(0, [11], 6, [7, 8, 2], [spec(0, step=3)], num_spec_tokens=2,
                          draft_start_pos=5, draft_token_ids=[10, 11]),
        ScheduledSequence(1, [20, 21, 22], 0, [3], [], draft_start_pos=0,
                          draft_token_ids=[20]),
        ScheduledSequence(2, [30, 31], 3, [5, 6], [spec(2, sampled, banned=[9]), spec(3)],
                          draft_start_pos=3, draft_token_ids=[30, 31]),
    ]
    out = SchedulerOutput(entries, [(6, 9)], [], 1 + 2 + 3 + 2, num_spec_tokens=2)
    model_input = build_model_input(out, block_size=BS, max_blocks_per_seq=3, max_spec_tokens=2)
    layout, f = model_input.layout, model_input.fields()
    assert (layout.num_tokens, layout.num_seqs, layout.num_logits) == (8, 4, 4)
    assert (layout.num_spec_tokens, layout.num_draft_tokens, layout.num_banned) == (2, 8, 1)
    assert not layout.decode and not layout.all_greedy and layout.use_filters
    assert layout.num_top_logprobs == MAX_LOGPROBS
    assert model_input.seq_ids == [0, 2, 3] and model_input.num_tokens == 8
    assert (model_input.max_query_len, model_input.max_draft_query_len) == (3, 2)
    np.testing.assert_array_equal(model_input.block_copies, [[6, 9]])
    # target tokens: seq 0's token + 2 draft slots, seq 1's chunk, seq 2's last prompt tokens
    np.testing.assert_array_equal(f["input_ids"], [11, 0, 0, 20, 21, 22, 30, 31])
    np.testing.assert_array_equal(f["positions"], [6, 7, 8, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(f["slot_mapping"], [34, 35, 8, 12, 13, 14, 23, 24])
    np.testing.assert_array_equal(f["query_start_loc"], [0, 3, 6, 8, 8])
    np.testing.assert_array_equal(f["kv_lens"], [9, 3, 5, 0])
    np.testing.assert_array_equal(f["block_tables"], [[7, 8, 2], [3, 0, 0], [5, 6, 0], [0, 0, 0]])
    # sample rows: seq 0 verifies 2 drafts after its last real token; the fork shares row 7
    np.testing.assert_array_equal(f["logits_indices"], [[0, 1, 2], [7, 7, 7], [7, 7, 7],
                                                        [0, 0, 0]])
    np.testing.assert_array_equal(f["banned_rows"], [1])
    np.testing.assert_array_equal(f["banned_token_ids"], [9])
    np.testing.assert_allclose(f["temperature"], [0.0, 0.7, 0.0, 0.0])
    np.testing.assert_array_equal(f["top_k"], [0, 5, 0, 0])
    assert f["rng_seed"].view(np.uint32)[:3].tolist() == [0xFFFFFFF0, 0xFFFFFFF2, 0xFFFFFFF3]
    np.testing.assert_array_equal(f["rng_step"][:3], [3, 0, 0])
    # the draft's catch-up pass
    np.testing.assert_array_equal(f["draft_input_ids"][:5], [10, 11, 20, 30, 31])
    np.testing.assert_array_equal(f["draft_positions"][:5], [5, 6, 0, 3, 4])
    np.testing.assert_array_equal(f["draft_slot_mapping"], [33, 34, 12, 23, 24, -1, -1, -1])
    np.testing.assert_array_equal(f["draft_query_start_loc"], [0, 2, 3, 5, 5])
    np.testing.assert_array_equal(f["draft_kv_lens"], [7, 1, 5, 0])
    np.testing.assert_array_equal(f["num_drafts"], [2, 0, 0, 0])
    np.testing.assert_array_equal(f["draft_token_index"], [[1, 2], [8, 8], [8, 8], [8, 8]])
    np.testing.assert_array_equal(f["seq_sample_row"], [0, 0, 1, 0])
    np.testing.assert_array_equal(f["sample_seq"][:3], [0, 2, 2])
    np.testing.assert_array_equal(f["num_draft_tokens"], [2, 0, 0, 0])


def test_decode_step_pads_tokens_to_sequences() -> None:
    entries = [ScheduledSequence(i, [i + 1], 5, [0, i + 1], [spec(i)]) for i in range(3)]
    model_input = build_model_input(SchedulerOutput(entries, [], [], 3), block_size=BS,
                                    max_blocks_per_seq=2)
    layout = model_input.layout
    assert layout.decode and layout.num_tokens == layout.num_seqs == layout.num_logits == 4
    assert layout.all_greedy and layout.num_spec_tokens == 0 and "draft_input_ids" not in \
        layout.int_fields
    f = model_input.fields()
    np.testing.assert_array_equal(f["slot_mapping"], [5, 9, 13, -1])
    np.testing.assert_array_equal(f["logits_indices"][:, 0], [0, 1, 2, 0])
    assert model_input.ints.size == layout.int_size and model_input.floats.size == 3 * 4


def test_unpack_is_a_view_of_the_buffers() -> None:
    layout = BatchLayout(num_tokens=2, num_seqs=1, num_logits=1, max_blocks_per_seq=3)
    ints = np.arange(layout.int_size, dtype=np.int32)
    fields = layout.unpack(ints, np.zeros(layout.float_size, np.float32))
    assert fields["input_ids"].tolist() == [0, 1] and fields["block_tables"].shape == (1, 3)
    fields["input_ids"][0] = 42
    assert ints[0] == 42


def test_output_rows_drop_padding() -> None:
    output = ModelOutput([5, 6], np.array([[3, 4, -1], [7, -1, -1]], np.int32),
                         np.zeros((2, 3), np.float32), None, None)
    assert output.token_lists() == [[3, 4], [7]]


def test_plain_steps_carry_no_penalty_bias_or_prompt_fields() -> None:
    """A step without such rows keeps the plain layout: same fields, same sizes, same key."""
    entries = [ScheduledSequence(i, [i + 1], 5, [0, i + 1], [spec(i)]) for i in range(3)]
    layout = build_model_input(SchedulerOutput(entries, [], [], 3), block_size=BS,
                               max_blocks_per_seq=2).layout
    assert (layout.num_penalty_tokens, layout.num_logit_bias, layout.num_prompt_logprobs) == (
        0, 0, 0)
    assert layout == BatchLayout(num_tokens=4, num_seqs=4, num_logits=4, max_blocks_per_seq=2,
                                 decode=True)
    assert list(layout.float_fields) == ["temperature", "top_p", "min_p"]
    assert not {"penalty_rows", "bias_rows", "prompt_logprobs_indices"} & set(layout.int_fields)


def test_penalties_logit_bias_and_prompt_logprobs_are_packed() -> None:
    """Seq 0 decodes with penalties (repetition: its distinct prompt tokens count 0, each output
    token 1); seq 1 is a prefill chunk scoring its prompt; seq 2 has a logit_bias and forks a
    plain sibling (seq 3)."""
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                               presence_penalty=-1.0)
    biased = SamplingParams(temperature=0.0, logit_bias={"7": 150, 9: -2.5})
    seq0 = SampleSpec(0, penalised, 0, 3, [], penalty_prompt_token_ids=[4, 8],
                      output_token_ids=[8, 8, 5])
    entries = [
        ScheduledSequence(0, [5], 6, [7, 8], [seq0]),
        ScheduledSequence(1, [20, 21, 22], 4, [3, 4], [], prompt_logprob_token_ids=[21, 22]),
        ScheduledSequence(2, [30], 3, [5], [spec(2, biased), spec(3)]),
    ]
    model_input = build_model_input(SchedulerOutput(entries, [], [], 5), block_size=BS,
                                    max_blocks_per_seq=2)
    layout, f = model_input.layout, model_input.fields()
    assert (layout.num_penalty_tokens, layout.num_logit_bias, layout.num_prompt_logprobs) == (
        16, 2, 2)  # Q starts at 16
    np.testing.assert_array_equal(f["penalty_rows"], [0] * 5 + [-1] * 11)
    np.testing.assert_array_equal(f["penalty_token_ids"][:5], [4, 8, 8, 8, 5])
    np.testing.assert_array_equal(f["penalty_counts"][:5], [0, 0, 1, 1, 1])
    np.testing.assert_allclose(f["repetition_penalty"], [1.5, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(f["frequency_penalty"], [0.5, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(f["presence_penalty"], [-1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(f["bias_rows"], [1, 1])  # sample row 1 is seq 2
    np.testing.assert_array_equal(f["bias_token_ids"], [7, 9])
    np.testing.assert_allclose(f["logit_bias"], [100.0, -2.5])  # clamped to [-100, 100]
    # seq 1's tokens are rows 1..3; rows 1 and 2 score prompt tokens 21 and 22 (positions 5, 6)
    np.testing.assert_array_equal(f["prompt_logprobs_indices"], [1, 2])
    np.testing.assert_array_equal(f["prompt_logprobs_token_ids"], [21, 22])
    assert model_input.prompt_logprobs_rows == [(1, 5, 2)]
    assert model_input.num_prompt_logprobs == 2
