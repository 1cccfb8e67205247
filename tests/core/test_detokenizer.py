"""Incremental detokenization is exact on multi-byte text; stop strings cut where they start."""

from __future__ import annotations

import random

import pytest

from pagedjax.checkpoints import MULTIBYTE_TEXT
from pagedjax.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedjax.sampling_params import SamplingParams
from pagedjax.sequence import Sequence
from pagedjax.stopping import StopChecker

TEXT = "def greet(name):\n    return f'héllo {name} — ✓ 日本語 😀🎉'\n" + MULTIBYTE_TEXT[:60]


def test_multibyte_text_really_splits_characters(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "pick text with split characters"


@pytest.mark.parametrize("seed", range(5))
def test_incremental_equals_full_decode(tokenizer, seed: int) -> None:
    prompt = tokenizer.encode("# a prompt ending mid-word: caf")
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    rng, i, text = random.Random(seed), 0, ""
    while i < len(ids):
        step = rng.choice([1, 1, 2, 3])
        delta = detok.append(ids[i : i + step])
        assert "\ufffd" not in delta
        text += delta
        i += step
    assert text == detok.output_text == tokenizer.decode(ids) == TEXT


def make_seq(tokenizer, params: SamplingParams, prompt: str = "x = ") -> Sequence:
    prompt_ids = tokenizer.encode(prompt)
    return Sequence(seq_id=0, request_id="r", index=0, arrival=(0, 0), token_ids=list(prompt_ids),
                    num_prompt_tokens=len(prompt_ids), sampling_params=params, max_tokens=1000,
                    rng_seed=0, detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids))


def run_until_stop(tokenizer, params: SamplingParams, text: str):
    seq, checker = make_seq(tokenizer, params), StopChecker((tokenizer.eos_token_id,), 4096)
    for token in tokenizer.encode(text):
        seq.token_ids.append(token)
        stop = checker(seq, [token])
        if stop is not None:
            return seq, stop
    return seq, None


def token_texts(tokenizer, text: str) -> list[str]:
    return [tokenizer.decode([t]) for t in tokenizer.encode(text)]


def test_stop_string_across_tokens(tokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    pieces = token_texts(tokenizer, text)
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 2]  # straddles the end of the second token
    seq, reason = run_until_stop(tokenizer, SamplingParams(stop=[stop]), text)
    assert reason == ("stop", stop)
    assert seq.detokenizer.output_text == text[: text.index(stop)]


def test_stop_string_inside_one_token(tokenizer) -> None:
    text = "return self.connection_pool"
    pieces = token_texts(tokenizer, text)
    k = max(range(len(pieces)), key=lambda i: len(pieces[i]))
    assert len(pieces[k]) >= 3
    start = len("".join(pieces[:k])) + 1
    stop = text[start : start + 1 + (len(pieces[k]) >= 4)]  # strictly inside token k
    seq, reason = run_until_stop(tokenizer, SamplingParams(stop=stop), text)
    assert reason == ("stop", stop)
    assert seq.detokenizer.output_text == text[: text.index(stop)]
    assert seq.num_output_tokens == k + 1


def test_include_stop_str_and_earliest_of_several(tokenizer) -> None:
    text = "one two three four"
    params = SamplingParams(stop=["four", "two"], include_stop_str_in_output=True)
    seq, reason = run_until_stop(tokenizer, params, text)
    assert reason == ("stop", "two") and seq.detokenizer.output_text == "one two"


def test_stop_tokens_eos_and_min_tokens(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    checker = StopChecker((eos,), 4096)
    seq = make_seq(tokenizer, SamplingParams(min_tokens=2, stop_token_ids=[7]))
    seq.token_ids.append(eos)
    assert checker(seq, [eos]) is None  # below min_tokens
    seq.token_ids += [5, eos]
    assert checker(seq, [eos]) == ("stop", None)
    seq = make_seq(tokenizer, SamplingParams(stop_token_ids=[7], ignore_eos=True, max_tokens=3))
    seq.max_tokens = 3
    seq.token_ids.append(eos)
    assert checker(seq, [eos]) is None
    seq.token_ids.append(7)
    assert checker(seq, [7]) == ("stop", 7)


def test_find_stop_string_only_looks_at_new_text() -> None:
    assert find_stop_string("abcabc", 1, ("abc",), False) == ("abc", 3)
    assert find_stop_string("abcxyz", 2, ("abc",), False) is None
