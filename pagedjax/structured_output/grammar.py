"""A request's constraint → an llguidance grammar: checked when the request is added, compiled
once per distinct constraint on a worker thread, off the engine loop.

llguidance (vLLM's "guidance" backend) was chosen over xgrammar: it installs as one 3 MB wheel
with no dependencies (xgrammar pulls in torch, triton and a TVM runtime), builds its token
masks lazily (a new schema compiles in about a millisecond, so no request waits behind another
one's grammar), and reads JSON schema, regex, Lark and GBNF itself. benchmarks/structured.py
measures both where xgrammar installs.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedjax.sampling_params import StructuredOutputsParams

MAX_CACHED = 1024  # compiled grammars kept (each a few kB to MBs of lazily built masks)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need the llguidance package; "
                         "pip install llguidance") from None
    return llguidance


def grammar_key(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON string) a constraint compiles to: also its cache key.
    Raises ValueError naming the constraint if it is not valid."""
    llguidance = _llguidance()
    kind, matcher = params.kind, llguidance.LLMatcher
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            grammar = matcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.json is not a valid JSON schema: {e}"
                             ) from None
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(params.regex)
    elif kind == "choice":
        grammar = llguidance.grammar_from("choice", params.choice)
    else:
        try:
            grammar = llguidance.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.grammar is not a valid EBNF/GBNF or Lark "
                             f"grammar: {e}") from None
    error = matcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"StructuredOutputsParams.{kind} is not valid: {error}")
    return grammar


class GrammarCompiler:
    """Compiles grammars for a tokenizer on one worker thread (llguidance drops the GIL while
    it builds one), each distinct grammar once: `compile` returns a future of a fresh matcher
    that requests copy (LLMatcher.deep_copy, microseconds)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer = None  # llguidance's, built on first use (~1 s for a 128k vocabulary)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedjax-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()  # the latest MAX_CACHED
        self.num_compiles = 0
        self.compile_seconds_total = 0.0

    def compile(self, grammar: str) -> Future:
        """A future of the grammar's compiled matcher (cached: an equal grammar shares it)."""
        with self._lock:
            future = self._cache.get(grammar)
            if future is None:
                future = self._cache[grammar] = self._pool.submit(self._build, grammar)
                if len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(grammar)
            return future

    def _build(self, grammar: str) -> Any:
        llguidance = _llguidance()
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size,
                eos_token=self._eos_token_ids or None)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        seconds = time.perf_counter() - start
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds_total += seconds
        if matcher.is_error():
            raise ValueError(f"the grammar did not compile: {matcher.get_error()}")
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
