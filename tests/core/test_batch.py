"""The packed batch: exact field contents for hand-made steps, the shape each step gets from the
closed set, the logit entries, and the output rows."""

from __future__ import annotations

import numpy as np

from pagedjax.core.batch import ModelOutput, StepFlags, buffer_sizes, unpack
from pagedjax.core.batch_reference import build_model_input
from pagedjax.core.logit_entries import EntryFlag
from pagedjax.core.scheduler_output import SampleSpec, ScheduledBatch, ScheduledSequence
from pagedjax.core.step_shapes import BatchLayout, StepShapes
from pagedjax.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0)
SHAPES = StepShapes.for_engine(max_num_seqs=4, max_num_batched_tokens=32, max_blocks_per_seq=3,
                               max_model_len=12, num_speculative_tokens=3)


def spec(seq_id: int, params: SamplingParams = GREEDY, step: int = 0,
         banned: list[int] | None = None) -> SampleSpec:
    return SampleSpec(seq_id, params, rng_seed=0xFFFFFFF0 + seq_id, rng_step=step,
                      banned_token_ids=banned or [])


def test_mixed_step_with_the_draft_catching_up() -> None:
    """Seq 0 decodes; seq 1 is a prefill chunk (no sample, partial draft catch-up); seq 2
    finishes its prompt and forks seq 3. A mixed step proposes no drafts: the draft only
    catches up, on the same token rows."""
    sampled = SamplingParams(temperature=0.7, top_k=5, logprobs=2)
    entries = [
        ScheduledSequence(0, [11], 6, [7, 8], [spec(0, step=3)], draft_start_pos=5,
                          draft_token_ids=[10, 11]),
        ScheduledSequence(1, [20, 21, 22], 0, [3], [], draft_start_pos=0, draft_token_ids=[20]),
        ScheduledSequence(2, [30, 31], 3, [5, 6], [spec(2, sampled, banned=[9]), spec(3)],
                          draft_start_pos=3, draft_token_ids=[30, 31]),
    ]
    model_input = build_model_input(ScheduledBatch(entries, [(6, 9)]), SHAPES,
                                    block_size=BS)
    layout, f = model_input.layout, model_input.fields()
    assert layout == BatchLayout(16, 4, 3, num_spec_tokens=0, draft=True)
    assert model_input.flags == StepFlags(sampled=True, filters=True, logprobs=True,
                                          logit_entries=True)
    assert f["step_flags"].tolist() == [1, 1, 1, 0, 1, 0]
    assert model_input.seq_ids == [0, 2, 3] and model_input.num_tokens == 6
    assert (model_input.max_query_len, model_input.max_draft_query_len) == (3, 2)
    np.testing.assert_array_equal(model_input.block_copies, [[6, 9]])
    np.testing.assert_array_equal(f["input_ids"][:6], [11, 20, 21, 22, 30, 31])
    np.testing.assert_array_equal(f["positions"][:6], [6, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(f["slot_mapping"][:7], [34, 12, 13, 14, 23, 24, -1])
    np.testing.assert_array_equal(f["query_start_loc"], [0, 1, 4, 6, 6])
    np.testing.assert_array_equal(f["kv_lens"], [7, 3, 5, 0])
    np.testing.assert_array_equal(f["block_tables"], [[7, 8, 0], [3, 0, 0], [5, 6, 0],
                                                      [0, 0, 0]])
    # one logits row per sample: seq 0's token, then seq 2's last token twice (the fork)
    np.testing.assert_array_equal(f["logits_indices"][:, 0], [0, 5, 5, 0])
    np.testing.assert_allclose(f["temperature"], [0.0, 0.7, 0.0, 0.0])
    np.testing.assert_array_equal(f["top_k"], [0, 5, 0, 0])
    assert f["rng_seed"].view(np.uint32)[:3].tolist() == [0xFFFFFFF0, 0xFFFFFFF2, 0xFFFFFFF3]
    # the draft's catch-up pass, T rows like the target's
    np.testing.assert_array_equal(f["draft_input_ids"][:5], [10, 11, 20, 30, 31])
    np.testing.assert_array_equal(f["draft_positions"][:5], [5, 6, 0, 3, 4])
    np.testing.assert_array_equal(f["draft_slot_mapping"][:6], [33, 34, 12, 23, 24, -1])
    np.testing.assert_array_equal(f["draft_query_start_loc"], [0, 2, 3, 5, 5])
    np.testing.assert_array_equal(f["num_drafts"], [0, 0, 0, 0])
    # min_tokens' ban: one entry of row 1
    entries_ = model_input.entries
    assert entries_.num_entries == 1
    np.testing.assert_array_equal(entries_.ints[:, :2], [[1, -1], [9, 0], [0, 0],
                                                         [EntryFlag.BANNED, 0]])


def test_speculative_decode_step() -> None:
    """Three decoding sequences proposing 2, 1 and 0 drafts: K is the smallest compiled k that
    holds them (2), T = S (K + 1), and draft j of each sequence has its slot."""
    entries = [
        ScheduledSequence(0, [5], 8, [1, 2, 3], [spec(0)], num_spec_tokens=2, draft_start_pos=7,
                          draft_token_ids=[4, 5]),
        ScheduledSequence(1, [6], 3, [4], [spec(1)], num_spec_tokens=1, draft_start_pos=3,
                          draft_token_ids=[6]),
        ScheduledSequence(2, [7], 2, [5], [spec(2)], draft_start_pos=2, draft_token_ids=[7]),
    ]
    model_input = build_model_input(ScheduledBatch(entries, [], 2), SHAPES,
                                    block_size=BS)
    layout, f = model_input.layout, model_input.fields()
    assert layout == BatchLayout(12, 4, 3, num_spec_tokens=2, draft=True)
    assert model_input.flags == StepFlags() and model_input.entries is None
    np.testing.assert_array_equal(f["input_ids"][:6], [5, 0, 0, 6, 0, 7])
    np.testing.assert_array_equal(f["positions"][:6], [8, 9, 10, 3, 4, 2])
    np.testing.assert_array_equal(f["logits_indices"], [[0, 1, 2], [3, 4, 4], [5, 5, 5],
                                                        [0, 0, 0]])
    np.testing.assert_array_equal(f["draft_token_index"], [[1, 2], [4, 12], [12, 12],
                                                           [12, 12]])
    np.testing.assert_array_equal(f["num_drafts"], [2, 1, 0, 0])
    np.testing.assert_array_equal(f["num_draft_tokens"], [2, 1, 0, 0])
    np.testing.assert_array_equal(f["draft_kv_lens"], [9, 4, 3, 0])


def test_a_long_draft_catch_up_takes_a_larger_k() -> None:
    """A decode step whose draft catches up on more than S (k + 1) tokens takes the smallest
    compiled k whose rows hold them (the scheduler caps a sequence's catch-up at k + 1)."""
    entries = [ScheduledSequence(0, [5], 8, [1, 2, 3], [spec(0)], num_spec_tokens=1,
                                 draft_start_pos=5, draft_token_ids=[1, 2, 3, 4])]
    layout = build_model_input(ScheduledBatch(entries, [], 1), SHAPES,
                               block_size=BS).layout
    assert layout == BatchLayout(4, 1, 3, num_spec_tokens=3, draft=True)


def test_decode_step_pads_tokens_to_sequences() -> None:
    entries = [ScheduledSequence(i, [i + 1], 5, [0, i + 1], [spec(i)]) for i in range(3)]
    model_input = build_model_input(ScheduledBatch(entries, []), SHAPES, block_size=BS)
    assert model_input.layout == BatchLayout(4, 4, 3, decode=True)
    assert "draft_input_ids" not in model_input.fields()
    f = model_input.fields()
    np.testing.assert_array_equal(f["slot_mapping"], [5, 9, 13, -1])
    np.testing.assert_array_equal(f["logits_indices"][:, 0], [0, 1, 2, 0])
    assert (model_input.ints.size, model_input.floats.size) == buffer_sizes(model_input.layout)


def test_features_never_change_the_shape() -> None:
    """Penalties, logit_bias, logprobs, filters and seeds change what a step's buffers hold and
    its flags, never its layout or buffer sizes."""
    def decode(params: SamplingParams) -> object:
        counted = ([4], [5, 5]) if params.has_penalties else ([], [])  # as Sequence gives them
        sample = SampleSpec(0, params, 7, 2, [], *counted)
        entries = [ScheduledSequence(0, [1], 5, [0, 1], [sample])]
        return build_model_input(ScheduledBatch(entries, []), SHAPES, block_size=BS)

    plain = decode(GREEDY)
    for params in (SamplingParams(temperature=0.9, top_p=0.5, seed=3, logprobs=5),
                   SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5,
                                  logit_bias={8: 2.0})):
        other = decode(params)
        assert other.layout == plain.layout
        assert (other.ints.size, other.floats.size) == (plain.ints.size, plain.floats.size)
        assert other.flags != plain.flags


def test_logit_entries_merge_each_row_and_token_once() -> None:
    """Seq 0 decodes with penalties (its distinct prompt tokens and output tokens: SEEN, with
    output counts) and a logit_bias on a seen token; seq 1 forks a sibling with a ban. Each
    (row, token) is one entry, sorted; the rest pads with row -1."""
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                               logit_bias={"8": 150, 9: -2.5})
    seq0 = SampleSpec(0, penalised, 0, 3, [], penalty_prompt_token_ids=[4, 8],
                      output_token_ids=[8, 8, 5])
    entries = [ScheduledSequence(0, [5], 6, [7, 8], [seq0]),
               ScheduledSequence(1, [30], 3, [5], [spec(1), spec(2, banned=[0, 9])])]
    model_input = build_model_input(ScheduledBatch(entries, []), SHAPES, block_size=BS)
    got = model_input.entries
    seen, banned = EntryFlag.SEEN, EntryFlag.BANNED
    assert got.num_entries == 6 and got.ints.shape == (4, SHAPES.num_logit_entries)
    np.testing.assert_array_equal(got.ints[:, :7], [
        [0, 0, 0, 0, 2, 2, -1],  # rows
        [4, 5, 8, 9, 0, 9, 0],  # tokens
        [0, 1, 2, 0, 0, 0, 0],  # output occurrences
        [seen, seen, seen, 0, banned, banned, 0]])
    np.testing.assert_allclose(got.bias[:7], [0, 0, 100.0, -2.5, 0, 0, 0])  # clamped
    f = model_input.fields()
    np.testing.assert_allclose(f["repetition_penalty"], [1.5, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(f["frequency_penalty"], [0.5, 0.0, 0.0, 0.0])


def test_prompt_logprobs_rows() -> None:
    """Seq 1 is a prefill chunk scoring two of its prompt tokens (rows 1 and 2)."""
    entries = [ScheduledSequence(0, [5], 6, [7, 8], [spec(0)]),
               ScheduledSequence(1, [20, 21, 22], 4, [3, 4], [],
                                 prompt_logprob_token_ids=[21, 22])]
    model_input = build_model_input(ScheduledBatch(entries, []), SHAPES, block_size=BS)
    f = model_input.fields()
    assert model_input.flags.prompt_logprobs and model_input.layout.num_tokens == 16
    np.testing.assert_array_equal(f["prompt_logprobs_indices"][:3], [1, 2, 0])
    np.testing.assert_array_equal(f["prompt_logprobs_token_ids"][:3], [21, 22, 0])
    assert model_input.prompt_logprobs_rows == [(1, 5, 2)]
    assert model_input.num_prompt_logprobs == 2


def test_unpack_is_a_view_of_the_buffers() -> None:
    layout = BatchLayout(num_tokens=2, num_seqs=1, max_blocks_per_seq=3)
    int_size, float_size = buffer_sizes(layout)
    ints = np.arange(int_size, dtype=np.int32)
    fields = unpack(layout, ints, np.zeros(float_size, np.float32))
    assert fields["input_ids"].tolist() == [0, 1] and fields["block_tables"].shape == (1, 3)
    fields["input_ids"][0] = 42
    assert ints[0] == 42


def test_unpack_of_named_fields_is_the_same_views() -> None:
    layout = BatchLayout(num_tokens=4, num_seqs=2, max_blocks_per_seq=3)
    int_size, float_size = buffer_sizes(layout)
    ints, floats = np.arange(int_size, dtype=np.int32), np.arange(float_size, dtype=np.float32)
    every = unpack(layout, ints, floats)
    names = ("top_p", "block_tables", "positions")
    some = unpack(layout, ints, floats, names)
    assert set(some) == set(names)
    for name in names:
        np.testing.assert_array_equal(some[name], every[name])
        assert some[name].shape == every[name].shape


def test_output_rows_drop_padding() -> None:
    output = ModelOutput([5, 6], np.array([[3, 4, -1], [7, -1, -1]], np.int32),
                         np.zeros((2, 3), np.float32), None, None)
    assert output.token_lists() == [[3, 4], [7]]
