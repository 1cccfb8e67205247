"""The closed set of step shapes: its members, its bound, and which member a step gets."""

from __future__ import annotations

import pytest

from pagedjax.core.step_shapes import BatchLayout, StepShapes


def shapes(k: int = 0, seqs: int = 64, tokens: int = 512) -> StepShapes:
    return StepShapes.for_engine(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                                 max_blocks_per_seq=64, max_model_len=1024,
                                 num_speculative_tokens=k)


def test_the_set_and_its_bound() -> None:
    plain = shapes()
    assert plain.seq_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert plain.token_buckets == (16, 32, 64, 128, 256, 512)
    layouts = plain.layouts()
    assert len(layouts) == len(set(layouts)) == 7 + 6  # decode + mixed
    speculative = shapes(k=4).layouts()
    assert len(speculative) == len(set(speculative)) == 13 + 7 * 2  # + speculative decode
    assert {layout.num_spec_tokens for layout in speculative} == {0, 2, 4}
    assert all(layout.draft for layout in speculative if not layout.decode)
    assert all(layout.max_blocks_per_seq == 64 for layout in speculative)


def test_compiled_ks_and_the_odd_sizes() -> None:
    assert shapes(k=10).spec_ks == (2, 4, 8, 10)
    assert shapes(k=16).spec_ks == (2, 4, 8, 16)
    assert shapes(k=1).spec_ks == (1,) and shapes(k=3).spec_ks == (2, 3)
    odd = shapes(seqs=6, tokens=100)
    assert odd.seq_buckets == (1, 2, 4, 8) and odd.token_buckets == (16, 32, 64, 128)
    assert shapes(seqs=4, tokens=8).token_buckets == (8,)  # a budget under 16 tokens
    assert shapes().num_logit_entries == 4096  # 4 x max_model_len


def test_each_step_gets_the_smallest_shape_that_holds_it() -> None:
    s = shapes(k=4)
    assert s.decode_layout(3) == BatchLayout(4, 4, 64, decode=True)
    assert shapes().mixed_layout(17) == BatchLayout(32, 32, 64)
    assert shapes().mixed_layout(5) == BatchLayout(16, 16, 64)
    assert s.mixed_layout(300) == BatchLayout(512, 64, 64, draft=True)  # the draft catches up
    assert s.spec_layout(5, 3) == BatchLayout(40, 8, 64, num_spec_tokens=4, draft=True)
    assert s.spec_layout(1, 1) == BatchLayout(3, 1, 64, num_spec_tokens=2, draft=True)
    assert all(layout in s.layouts() for layout in (s.decode_layout(64), s.spec_layout(1, 2),
                                                    s.mixed_layout(512)))
    for bad in (lambda: s.decode_layout(65), lambda: s.mixed_layout(513), lambda: s.spec_k(5)):
        with pytest.raises(ValueError):
            bad()


def test_a_backends_smallest_sequence_bucket() -> None:
    """jax on a GPU pads decode steps to 16 sequences at least (min_decode_rows): fewer shapes,
    and a 1-sequence step runs the 16-row one; a max_num_seqs under it leaves one bucket."""
    def gpu(seqs: int) -> StepShapes:
        return StepShapes.for_engine(max_num_seqs=seqs, max_num_batched_tokens=512,
                                     max_blocks_per_seq=64, max_model_len=1024,
                                     num_speculative_tokens=4, min_num_seqs=16)

    assert gpu(64).seq_buckets == (16, 32, 64) and gpu(4).seq_buckets == (16,)
    assert gpu(64).decode_layout(1) == BatchLayout(16, 16, 64, decode=True)
    assert gpu(4).spec_layout(1, 3) == BatchLayout(80, 16, 64, num_spec_tokens=4, draft=True)
    assert gpu(4).mixed_layout(40) == BatchLayout(64, 16, 64, draft=True)
