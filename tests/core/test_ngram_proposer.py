"""n-gram prompt lookup's proposals equal the one-sequence-at-a-time definition."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.core.ngram_proposer import NgramProposer, reference_propose
from pagedjax.core.spec_decode import SpeculativeConfig


@pytest.mark.parametrize(("k", "min_n", "max_n", "vocab"),
                         [(4, 1, 3, 3), (3, 2, 4, 4), (5, 2, 2, 2), (2, 3, 5, 3), (4, 1, 1, 6)])
def test_proposals_equal_the_definition_on_random_streams(k: int, min_n: int, max_n: int,
                                                          vocab: int) -> None:
    """Rows of random lengths (0 to 60) over small vocabularies, so that n-grams repeat (and
    sometimes do not); padding past each row's length holds tokens that must not match."""
    rng = np.random.default_rng(k * 100 + min_n * 10 + max_n)
    proposer = NgramProposer(k, min_n, max_n)
    lengths = rng.integers(0, 60, 200)
    tokens = rng.integers(0, vocab, (200, 80)).astype(np.int32)
    drafts, counts = proposer.propose(tokens, lengths)
    found = 0
    for r, n in enumerate(lengths.tolist()):
        want = reference_propose(tokens[r, :n].tolist(), k, min_n, max_n)
        assert drafts[r, : counts[r]].tolist() == want, (r, tokens[r, :n].tolist())
        assert not drafts[r, counts[r]:].any()
        found += bool(want)
    assert 20 < found < 200  # both cases occur
    # a subset of the rows, in any order: one vectorized pass, or each row on its own (up to
    # FEW_ROWS of them)
    for size in (37, proposer.FEW_ROWS, 3, 1):
        which = rng.permutation(200)[:size]
        sub_drafts, sub_counts = proposer.propose(tokens, lengths, which)
        np.testing.assert_array_equal(sub_drafts, drafts[which])
        np.testing.assert_array_equal(sub_counts, counts[which])
    for start in range(0, 200, proposer.FEW_ROWS):  # every row, a few at a time
        which = np.arange(start, min(start + proposer.FEW_ROWS, 200))
        sub_drafts, sub_counts = proposer.propose(tokens, lengths, which)
        np.testing.assert_array_equal(sub_drafts, drafts[which])
        np.testing.assert_array_equal(sub_counts, counts[which])


def test_the_longest_ngram_wins_then_its_earliest_occurrence() -> None:
    proposer = NgramProposer(3, 1, 3)
    # suffix [7, 8]: the 2-gram occurs at 1 (then 9, 4) and 5 (then 5, ...); the 1-gram [8]
    # occurs later too, but the longest match decides, then the earliest
    tokens = np.array([[1, 7, 8, 9, 4, 7, 8, 5, 8, 7, 8]], np.int32)
    drafts, counts = proposer.propose(tokens, np.array([11]))
    assert drafts[0, : counts[0]].tolist() == [9, 4, 7]
    # a match near the end proposes only the tokens that exist
    drafts, counts = proposer.propose(np.array([[5, 6, 5, 6]], np.int32), np.array([4]))
    assert drafts[0, : counts[0]].tolist() == [5, 6]
    # nothing repeats: nothing proposed
    _, counts = proposer.propose(np.array([[1, 2, 3, 4]], np.int32), np.array([4]))
    assert counts.tolist() == [0]


@pytest.mark.parametrize("rows", [1, 9])  # searched as bytes, and vectorized
def test_a_match_inside_the_bytes_of_other_tokens_is_no_occurrence(rows: int) -> None:
    """The suffix [1, 2]'s bytes (int32, little-endian: 01 00 00 00 02 00 00 00) occur one
    byte into [256, 512, 0]; only the occurrence at 3 is one."""
    proposer = NgramProposer(2, 1, 2)
    tokens = np.tile(np.array([[256, 512, 0, 1, 2, 9, 1, 2]], np.int32), (rows, 1))
    drafts, counts = proposer.propose(tokens, np.full(rows, 8))
    assert drafts[:, :2].tolist() == [[9, 1]] * rows and counts.tolist() == [2] * rows
    drafts, counts = proposer.propose(tokens[:, [0, 1, 2, 6, 7]], np.full(rows, 5))
    assert counts.tolist() == [0] * rows


def test_ngram_config_is_vllms() -> None:
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 4})
    assert (config.method, config.model, config.num_speculative_tokens) == ("ngram", None, 3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)  # one sets both
    assert not config.uses_draft_model
    with pytest.raises(ValueError, match="prompt_lookup_min=5 exceeds prompt_lookup_max=2"):
        SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 5,
                                     "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="prompt_lookup_max=0"):
        SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 0})
    with pytest.raises(ValueError, match="uses no draft model"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "/some/draft"})
    with pytest.raises(ValueError, match="method='eagle' is not supported"):
        SpeculativeConfig.from_dict({"method": "eagle", "model": "/some/draft"})
    with pytest.raises(ValueError, match="'model'.*or a 'method'"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3})


@pytest.mark.parametrize("lag", [False, True])
def test_the_drafter_proposes_for_a_step_launched_ahead(lag: bool) -> None:
    """NgramDrafter over a persistent batch's rows: k drafts each, or with lag (a step launched
    while the one before it runs, whose token the host has not seen) the k after the first of
    k + 1 (that first one a guess of the token in flight); rows left with none are absent."""
    from types import SimpleNamespace

    from pagedjax.core.host_drafts import NgramDrafter

    rng = np.random.default_rng(7 + lag)
    k, rows = 3, 64
    lengths = rng.integers(0, 40, rows)
    tokens = rng.integers(0, 3, (rows, 48)).astype(np.int32)
    batch = SimpleNamespace(token_ids=tokens, num_tokens=lengths,
                            row_of={100 + r: r for r in range(rows)})
    config = SpeculativeConfig(model=None, method="ngram", num_speculative_tokens=k,
                               prompt_lookup_min=1, prompt_lookup_max=3)
    got = NgramDrafter(config).propose(None, batch, k, lag=lag)
    want = {}
    for r, n in enumerate(lengths.tolist()):
        drafts = reference_propose(tokens[r, :n].tolist(), k + lag, 1, 3)[lag:]
        if drafts:
            want[100 + r] = drafts
    assert got == want and 0 < len(want) < rows
