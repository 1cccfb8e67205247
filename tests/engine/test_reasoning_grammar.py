"""StructuredOutputManager with a reasoning parser's markers: a completion reasons unconstrained,
its grammar applies from the token after `</think>` (within a speculative row too), and a prompt
that already closed the reasoning is constrained from its first token."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.core.scheduler_output import SampledTokens
from pagedjax.core.sequence import Sequence
from pagedjax.reasoning.token_ids import engine_reasoning_parser
from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams
from pagedjax.structured_output import StructuredOutputManager
from pagedjax.structured_output.grammar import grammar_key


@pytest.fixture(scope="module")
def think_tokenizer(tokenizer, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("think_tokenizer")
    tokenizer.save_pretrained(folder)
    think = AutoTokenizer.from_pretrained(folder)
    think.add_tokens(["<think>", "</think>"])
    return think


def ready_seq(manager: StructuredOutputManager, prompt: list[int]) -> Sequence:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    seq = Sequence(seq_id=0, request_id="r", index=0, arrival=(0, 0), token_ids=list(prompt),
                   num_prompt_tokens=len(prompt), sampling_params=params, max_tokens=16,
                   rng_seed=0)
    manager.add_request(seq, grammar_key(params.structured_outputs))
    for _ in range(200):
        ready, failed = manager.take_ready()
        assert not failed
        if ready:
            return seq
        manager.wait(0.05)
    raise AssertionError("the grammar did not compile")


def allowed(manager: StructuredOutputManager, seq: Sequence) -> np.ndarray | None:
    mask = manager.bitmask([seq])
    if mask is not None:
        manager.finish_bitmask(mask)
    return mask


def test_the_grammar_waits_for_the_end_of_the_reasoning(think_tokenizer) -> None:
    start_id, end_id = think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    yes = think_tokenizer.encode("yes", add_special_tokens=False)
    free = think_tokenizer.encode("zzz", add_special_tokens=False)
    manager = StructuredOutputManager(think_tokenizer, len(think_tokenizer), (0,),
                                      engine_reasoning_parser("deepseek_r1", think_tokenizer))
    seq = ready_seq(manager, [5, 6, start_id])
    mask = allowed(manager, seq)
    assert mask is None or (mask == -1).all()  # reasoning: every token allowed
    assert manager.accept({0: seq}, SampledTokens.from_lists({0: free[:2] + [7]}), 2) == []
    assert manager.accept({0: seq}, SampledTokens.from_lists({0: free[:1]}), 0) == []
    mask = allowed(manager, seq)
    assert mask is None or (mask == -1).all()

    # a speculative row that closes the reasoning and goes on: kept up to the first token
    # the grammar forbids after </think>
    row = SampledTokens.from_lists({0: [free[0], end_id, free[0], yes[0]]})
    assert manager.accept({0: seq}, row, 3) == [seq]
    assert row.tokens(0) == [free[0], end_id]
    mask = allowed(manager, seq)
    assert mask is not None and not (mask == -1).all()  # the answer: constrained
    bit = (mask[0, yes[0] // 32] >> (yes[0] % 32)) & 1
    assert bit == 1
    row = SampledTokens.from_lists({0: yes})
    manager.accept({0: seq}, row, len(yes) - 1)
    assert row.tokens(0) == yes
    manager.shutdown()


def test_a_prompt_that_closed_the_reasoning_is_constrained_at_once(think_tokenizer) -> None:
    start_id, end_id = think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    manager = StructuredOutputManager(think_tokenizer, len(think_tokenizer), (0,),
                                      engine_reasoning_parser("deepseek_r1", think_tokenizer))
    seq = ready_seq(manager, [5, start_id, 9, end_id, 6])
    mask = allowed(manager, seq)
    assert mask is not None and not (mask == -1).all()
    manager.shutdown()
