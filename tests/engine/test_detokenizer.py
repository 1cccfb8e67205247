"""Incremental detokenization is exact on multi-byte text; stop strings cut where they start."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagedjax.core.sequence import Sequence
from pagedjax.core.stopping import StopChecker
from pagedjax.engine.core_messages import EngineCoreOutputs, EngineCoreRequest, SeqOutput
from pagedjax.engine.detokenizer import IncrementalDetokenizer, find_stop_string, token_decoder
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.testing.checkpoints import MULTIBYTE_TEXT

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
                    num_prompt_tokens=len(prompt_ids), sampling_params=params,
                    max_tokens=params.max_tokens or 1000, rng_seed=0)


def stream(tokenizer, params: SamplingParams, chunks: list[list[int]]) -> list[RequestOutput]:
    """Feed each chunk as one step's new tokens (several when drafts were accepted), as the
    engine core sends them (its token-level stops applied; every step, or at the end for a
    request that wants one output), through the output processor; returns every output."""
    checker = StopChecker((tokenizer.eos_token_id,), 4096)
    processor = OutputProcessor(tokenizer)
    seq = make_seq(tokenizer, params)
    request = EngineCoreRequest("r", seq.token_ids[:], params, seq.max_tokens)
    processor.add_request(request, "x = ")
    every_step = processor.requests["r"].every_step
    outputs, sent = [], seq.num_prompt_tokens
    for chunk in chunks:
        finish = None
        for token in chunk:
            seq.token_ids.append(token)
            finish = checker(seq, token)
            if finish is not None:
                break
        if not every_step and finish is None:
            continue
        new, sent = seq.token_ids[sent:], seq.num_tokens
        core_out = EngineCoreOutputs([SeqOutput("r", 0, new, *(finish or (None, None)))])
        results, finishes = processor.process(core_out)
        outputs += results
        if finish is not None or finishes:
            break
    return outputs


def run_until_stop(tokenizer, params: SamplingParams, text: str) -> CompletionOutput:
    final = stream(tokenizer, params, [[t] for t in tokenizer.encode(text)])[-1]
    assert final.finished
    return final.outputs[0]


def token_texts(tokenizer, text: str) -> list[str]:
    return [tokenizer.decode([t]) for t in tokenizer.encode(text)]


def test_stop_string_across_tokens(tokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    pieces = token_texts(tokenizer, text)
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 2]  # straddles the end of the second token
    out = run_until_stop(tokenizer, SamplingParams(stop=[stop]), text)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[: text.index(stop)]


def test_stop_string_inside_one_token(tokenizer) -> None:
    text = "return self.connection_pool"
    pieces = token_texts(tokenizer, text)
    k = max(range(len(pieces)), key=lambda i: len(pieces[i]))
    assert len(pieces[k]) >= 3
    start = len("".join(pieces[:k])) + 1
    stop = text[start : start + 1 + (len(pieces[k]) >= 4)]  # strictly inside token k
    out = run_until_stop(tokenizer, SamplingParams(stop=stop), text)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) == k + 1


def test_include_stop_str_and_earliest_of_several(tokenizer) -> None:
    text = "one two three four"
    params = SamplingParams(stop=["four", "two"], include_stop_str_in_output=True)
    out = run_until_stop(tokenizer, params, text)
    assert (out.stop_reason, out.text) == ("two", "one two")


def test_stop_tokens_eos_and_min_tokens(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    checker = StopChecker((eos,), 4096)
    seq = make_seq(tokenizer, SamplingParams(min_tokens=2, stop_token_ids=[7]))
    seq.token_ids.append(eos)
    assert checker(seq, eos) is None  # below min_tokens
    seq.token_ids += [5, eos]
    assert checker(seq, eos) == ("stop", None)
    seq = make_seq(tokenizer, SamplingParams(stop_token_ids=[7], ignore_eos=True, max_tokens=3))
    seq.max_tokens = 3
    seq.token_ids.append(eos)
    assert checker(seq, eos) is None
    seq.token_ids.append(7)
    assert checker(seq, 7) == ("stop", 7)
    seq.token_ids.append(8)
    assert checker(seq, 8) == ("length", None)


def test_find_stop_string_only_looks_at_new_text() -> None:
    assert find_stop_string("abcabc", 1, ("abc",), False) == ("abc", 3)
    assert find_stop_string("abcxyz", 2, ("abc",), False) is None


@pytest.mark.parametrize("seed", range(3))
def test_streamed_deltas_equal_one_shot_decode(tokenizer, seed: int) -> None:
    """DELTA outputs of steps carrying 1-4 tokens (speculative steps) join to the full decode,
    with multi-byte characters split across tokens and steps."""
    ids = tokenizer.encode(TEXT)
    rng, chunks, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i : i + n])
        i += n
    params = SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.DELTA)
    outputs = stream(tokenizer, params, chunks)
    assert "".join(o.outputs[0].text for o in outputs) == TEXT == tokenizer.decode(ids)
    assert sum((o.outputs[0].token_ids for o in outputs), []) == ids
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    cumulative = stream(tokenizer, SamplingParams(max_tokens=len(ids)), chunks)
    assert [o.outputs[0].text for o in cumulative][-1] == TEXT
    final = stream(tokenizer, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY),
                   chunks)
    assert len(final) == 1 and final[0].outputs[0].text == TEXT


def test_stop_string_spanning_a_multi_token_step_cuts_the_tokens_after_it(tokenizer) -> None:
    """A stop string completed by the second of four tokens accepted in one step: the text ends
    before it and the two tokens after it are dropped."""
    text = "alpha beta gamma delta epsilon zeta"
    ids, pieces = tokenizer.encode(text), token_texts(tokenizer, text)
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 1]  # spans tokens 1 and 2
    chunks = [ids[:1], ids[1:5], ids[5:]]
    out = stream(tokenizer, SamplingParams(stop=stop), chunks)[-1].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, text[: boundary - 2])
    assert out.token_ids == ids[:3]


def test_streamed_deltas_never_send_text_a_later_stop_string_cuts(tokenizer) -> None:
    """DELTA holds back the last len(longest stop) - 1 characters until the request finishes:
    a stop string that starts in one step's text and ends in the next never leaks its start."""
    text = "alpha beta gamma delta epsilon zeta"
    ids, pieces = tokenizer.encode(text), token_texts(tokenizer, text)
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 2]  # starts in token 1, ends in token 2
    params = SamplingParams(stop=[stop, "zz"], output_kind=RequestOutputKind.DELTA)
    outputs = stream(tokenizer, params, [[t] for t in ids])
    assert "".join(o.outputs[0].text for o in outputs) == text[: boundary - 2]
    assert outputs[-1].outputs[0].finish_reason == "stop"


def test_decoder_is_the_rust_tokenizers_unless_transformers_cleans_up(tokenizer) -> None:
    """The detokenizer calls the Rust tokenizer's decode directly (a third of the cost) only
    where transformers' decode gives the same text: not where it cleans up spaces."""
    assert token_decoder(tokenizer) == tokenizer._tokenizer.decode
    assert token_decoder(None) is None

    class CleansUp:  # transformers' clean-up of tokenization spaces, on the same tokenizer
        _tokenizer = tokenizer._tokenizer
        encode = tokenizer.encode

        def decode(self, ids, skip_special_tokens=False):
            text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            return text.replace(" .", ".").replace(" ,", ",")

    cleans_up = CleansUp()
    decode = token_decoder(cleans_up)
    ids = tokenizer.encode("a , b .")
    assert decode != tokenizer._tokenizer.decode and decode(ids, True) == "a, b."
