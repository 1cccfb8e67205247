"""The structured-output corpus (tests/support/structured_cases.py) checks itself, with
llguidance and no engine: random walks through each case's grammar (a uniformly random allowed
token each step, the demo target's tokenizer) all finish within the case's max_tokens and pass
its checker, and the checkers reject what is not in their language."""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest

from pagedjax.model_loader.demo import DEMO_DIR
from pagedjax.sampling_params import StructuredOutputsParams
from tests.support.structured_cases import (
    CASES,
    CHOICE_CASES,
    GRAMMAR_CASES,
    JSON_CASES,
    REGEX_CASES,
    json_max_bytes,
    max_tokens_for,
)

WALKS = 20


@pytest.fixture(scope="module")
def demo_tokenizer():
    from pagedjax.model_loader.tokenizer import load_eos_token_ids, load_tokenizer

    target = str(DEMO_DIR / "target")
    hf = load_tokenizer(target)
    eos = load_eos_token_ids(target, hf)
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=list(eos)), eos


def random_walk(matcher, vocab_size: int, eos: tuple[int, ...], rng: np.random.Generator
                ) -> tuple[list[int], bool]:
    """(tokens, ended by EOS): a uniformly random allowed token each step until the grammar is
    finished (is_stopped) or EOS is drawn; an EOS drawn counts as a token, as in the engine."""
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    tokens: list[int] = []
    while not matcher.is_stopped():
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        assert allowed.size, matcher.get_error()
        token = int(rng.choice(allowed))
        tokens.append(token)
        if token in eos:
            return tokens, True
        assert matcher.consume_token(token), matcher.get_error()
    return tokens, False


def test_the_corpus_covers_what_the_issue_lists() -> None:
    assert len(JSON_CASES) >= 20 and len(REGEX_CASES) >= 5
    assert len(CHOICE_CASES) >= 4 and len(GRAMMAR_CASES) >= 4
    text = " ".join(repr(case.params.json) for case in JSON_CASES)
    for keyword in ("'properties': {'id'", "minItems", "maxItems", "enum", "minimum",
                    "maximum", "exclusiveMinimum", "multipleOf", "'boolean'", "maxLength",
                    "pattern", "anyOf", "oneOf", "const", "['string', 'null']", "$ref",
                    "prefixItems"):
        assert keyword in text, keyword
    schemas = [case.params.json for case in JSON_CASES]
    assert any(len(s.get("required", [])) < len(s.get("properties", {})) for s in schemas)
    assert any(case.params.whitespace_pattern for case in JSON_CASES)
    assert any(case.params.disable_any_whitespace for case in JSON_CASES)


@pytest.mark.parametrize("unbounded", [
    {"type": "string"},
    {"type": "string", "pattern": "[a-z]{2}"},  # unanchored: anything containing it
    {"type": "array", "items": {"type": "null"}},
    {"type": "number", "minimum": 0, "maximum": 1},  # unbounded decimals
    {"type": "integer", "minimum": 0},
    {"type": "object", "properties": {"a": {"type": "null"}}},  # additional properties
])
def test_unbounded_schemas_are_refused(unbounded: dict) -> None:
    with pytest.raises(ValueError):
        json_max_bytes(unbounded)


def test_random_walks_finish_within_max_tokens_and_pass_their_checks(demo_tokenizer) -> None:
    from pagedjax.structured_output import grammar_key

    hf, lltok, eos = demo_tokenizer
    failures = []
    for case in CASES:
        assert max_tokens_for(case) <= 512, case.name  # cheap for a tiny model's test
        compiled = llguidance.LLMatcher(lltok, grammar_key(case.params), log_level=0)
        assert not compiled.is_error(), f"{case.name}: {compiled.get_error()}"
        rng = np.random.default_rng(0)
        texts = set()
        for _ in range(WALKS):
            tokens, by_eos = random_walk(compiled.deep_copy(), len(hf), eos, rng)
            text = hf.decode(tokens[:-1] if by_eos else tokens, skip_special_tokens=True)
            texts.add(text)
            if len(tokens) > max_tokens_for(case):
                failures.append(f"{case.name}: {len(tokens)} tokens > max_tokens "
                                f"{max_tokens_for(case)}: {text!r}")
            try:
                case.check(text)
            except AssertionError as e:
                failures.append(str(e))
            with pytest.raises(AssertionError, match=case.name):
                case.check(text + "\x07")
        with pytest.raises(AssertionError, match=case.name):
            case.check("")
        if case.kind != "choice":
            assert len(texts) > 1, f"{case.name}: every walk gave {texts}"
    assert not failures, "\n".join(failures)


def test_checkers_reject_near_misses() -> None:
    from tests.support.structured_cases import CASES_BY_NAME as C

    misses = {
        "json_person": ['{"name":"Al","age":121}', '{"name":"Al"}', '{"name": "Al","age":3}',
                        '{"name":"Al","age":3,"x":1}'],
        "json_point": ['{"x":1,  "y":2}', '{"x":1.5,"y":2}'],
        "json_prices": ['{"price":1.3,"discount":0,"quantity":1}',
                        '{"price":1,"discount":0,"quantity":0}'],
        "json_codes": ['{"sku":"AB-12","word":"ok","date":"2024-01-01"}'],
        "json_const_fields": ['{"version":3,"kind":"point","value":1}'],
        "json_one_of_shapes": ['{"kind":"circle","w":1,"h":2}'],
        "regex_ipv4": ["256.1.1.1", "1.2.3"],
        "choice_prefixes": ["abcd", "c"],
        "grammar_arithmetic": ["1+", "((1))", "01+2", "1 + 2"],
        "grammar_key_value": ["a=1,", "a=yes"],
        "grammar_yes_no": ["Maybe.", "Yes"],
        "grammar_csv_row": ["1,2", '1,"A",3'],
        "grammar_lark_int_list": ["[1,2]", "[1, 2, 3, 4, 5]"],
    }
    for name, texts in misses.items():
        for text in texts:
            with pytest.raises(AssertionError, match=name):
                C[name].check(text)
    assert StructuredOutputsParams(json=C["json_person"].params.json).json == \
        C["json_person"].params.json
