"""Beam search inside the engine (vLLM's API names), scored and stopped as HF transformers'
`generate(num_beams=W, do_sample=False, length_penalty=..., early_stopping=...)`.

Each live beam is a sequence. Every step it computes its last token and returns the top
logprobs of its next position; once every beam of the request has its row, the policy takes the
best `max(2, 1 + #EOS) * W` continuations over all beams (cumulative logprob, summed in float32
as HF does). Of these, the top W that end (EOS, or max_tokens) become finished hypotheses scored
`cum_logprob / generated_len ** length_penalty`; the best W that go on are the next beams. A
parent chosen k times continues itself and forks k - 1 children that share its blocks; parents
chosen 0 times are dropped and free theirs. The search ends as HF's does: when no running beam can
beat the worst of W finished hypotheses (early_stopping False: judged at the current length;
"never": at max_tokens when length_penalty > 0), as soon as W hypotheses are finished
(early_stopping True), or at max_tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from pagedjax.core.batch import ModelOutput
from pagedjax.core.request_policy import PolicyContext
from pagedjax.core.scheduler_output import SchedulerOutput
from pagedjax.core.sequence import Sequence
from pagedjax.outputs import CompletionOutput, Logprob, Logprobs, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    """How to beam-search one request (vLLM's names; early_stopping as HF's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"

    def __post_init__(self) -> None:
        _check(isinstance(self.beam_width, int) and self.beam_width >= 1, "beam_width",
               self.beam_width, "an integer >= 1")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               self.max_tokens, "an integer >= 1")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        _check(self.temperature == 0.0, "temperature", self.temperature,
               "0.0: beam search is deterministic here, as HF's with do_sample=False")
        _check(isinstance(self.length_penalty, (int, float)) and math.isfinite(
            self.length_penalty), "length_penalty", self.length_penalty, "a finite float")
        _check(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
               "early_stopping", self.early_stopping, 'True, False or "never"')

    def num_candidates(self, num_eos_token_ids: int) -> int:
        """Continuations kept per step (HF's beams_to_keep): enough that W go on even if every
        beam's best ones end."""
        num_eos = 0 if self.ignore_eos else num_eos_token_ids
        return max(2, 1 + num_eos) * self.beam_width

    def sampling_params(self, num_candidates: int) -> SamplingParams:
        """What each beam's rows ask the runner for: the greedy token (unused) and the top
        num_candidates logprobs of the raw model. The policy does the stopping."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True,
                              logprobs=num_candidates, output_kind=RequestOutputKind.FINAL_ONLY)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"BeamSearchParams.{name}={value!r} is invalid: expected {expected}.")


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM's: `tokens` include the prompt; `logprobs` hold each
    generated token's logprob; `text` is the generated text."""

    tokens: list[int]
    logprobs: Logprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A request's beams, best first (by length-normalised score)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    seq: Sequence
    score: np.float32  # cumulative logprob
    logprobs: list[tuple[float, int]]  # (logprob, rank) of each generated token


@dataclass
class _Hypothesis:
    score: np.float32  # cum_logprob / len(token_ids) ** length_penalty
    token_ids: list[int]  # generated, EOS included
    logprobs: list[tuple[float, int]]
    cum_logprob: np.float32
    finish_reason: str


@dataclass
class _Candidates:
    """The step's best continuations over all beams, best first: [num_candidates] each."""

    parent: np.ndarray  # index into beams
    token: np.ndarray
    logprob: np.ndarray
    rank: np.ndarray  # 1 = the parent's most likely token
    score: np.ndarray  # float32 cumulative logprob
    ends: np.ndarray  # bool: EOS or max_tokens


@functools.lru_cache(maxsize=64)
def _parents_and_ranks(width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For beams x k candidates flattened: each one's beam [width * k] and rank [width * k]."""
    return np.repeat(np.arange(width), k), np.tile(np.arange(1, k + 1), width)


class BeamSearch:
    """The RequestPolicy of one beam-search request (see the module docstring)."""

    def __init__(self, root: Sequence, params: BeamSearchParams, prompt: str | None,
                 context: PolicyContext) -> None:
        self.params = params
        self.prompt = prompt
        self.context = context
        self.root = root
        # As HF's generate: one beam is greedy search, which ends at the first EOS.
        self.early_stopping = True if params.beam_width == 1 else params.early_stopping
        self.eos = frozenset(() if params.ignore_eos else context.eos_token_ids)
        self._eos_array = np.array(sorted(self.eos), np.int64)
        self.num_candidates = params.num_candidates(len(context.eos_token_ids))
        root.policy_picks_tokens = True
        root.num_pending_forks = params.beam_width - 1  # the beams to come hold their seats
        self.beams = [_Beam(root, np.float32(0.0), [])]  # running, best first
        self.hypotheses: list[_Hypothesis] = []  # finished, best first, at most beam_width
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # seq id -> (ids, logprobs)
        self._num_generated = 0
        self._num_forks = 0
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def schedule(self, out: SchedulerOutput, indices: list[int]) -> None:
        pass  # every beam samples from its own last position; nothing to add

    def update(self, output: ModelOutput, rows: dict[int, int]) -> RequestOutput | None:
        k = self.num_candidates
        beam_rows = [rows.get(beam.seq.seq_id) for beam in self.beams]
        if self._rows or None in beam_rows:
            # A beam was not scheduled this step (budget, preemption): keep the others' rows
            # and wait for it.
            for beam, row in zip(self.beams, beam_rows, strict=True):
                if row is not None:
                    self._rows[beam.seq.seq_id] = (output.top_logprob_ids[row, 0, :k].copy(),
                                                   output.top_logprobs[row, 0, :k].copy())
            if len(self._rows) < len(self.beams):
                return None
            pending = [self._rows.pop(beam.seq.seq_id) for beam in self.beams]
            ids, lps = np.stack([i for i, _ in pending]), np.stack([lp for _, lp in pending])
        else:
            ids = output.top_logprob_ids[beam_rows, 0, :k]  # [beams, k]
            lps = output.top_logprobs[beam_rows, 0, :k]
        candidates = self._candidates(ids, lps.astype(np.float32))
        self._num_generated += 1
        self._add_hypotheses(candidates)
        if self._finished(candidates):
            return self._finish()
        self._advance(candidates)
        return None

    def abort(self) -> None:
        for beam in self.beams:
            self.context.drop(beam.seq)
        self.beams, self._done = [], True

    # ---- one step, as HF's _beam_search ------------------------------------------------------

    def _candidates(self, ids: np.ndarray, lps: np.ndarray) -> _Candidates:
        """The top num_candidates of (beam score + logprob) over all beams, from each beam's
        top num_candidates ids [beams, k] and float32 logprobs [beams, k]; ties go to the
        earlier beam, then the lower token id (HF's top-k over the flattened beams x vocab)."""
        k, width = self.num_candidates, len(self.beams)
        tokens, logprobs = ids.reshape(-1), lps.reshape(-1)
        parent, rank = _parents_and_ranks(width, k)
        beam_scores = np.array([beam.score for beam in self.beams], np.float32)
        score = (beam_scores[:, None] + lps).reshape(-1)
        order = np.lexsort((tokens, parent, -score))[:k]
        chosen = tokens[order]
        ends = np.isin(chosen, self._eos_array) if len(self._eos_array) else np.zeros(k, bool)
        ends |= self._num_generated + 1 >= self.params.max_tokens
        return _Candidates(parent[order], chosen, logprobs[order], rank[order], score[order],
                           ends)

    def _add_hypotheses(self, c: _Candidates) -> None:
        """Of the best beam_width candidates, those that end join the finished hypotheses
        (unless the search can no longer improve, or early_stopping=True and W are done)."""
        width = self.params.beam_width
        full = len(self.hypotheses) == width
        if not self.improvable or (full and self.early_stopping is True):
            return
        new = []
        denominator = np.float32(self._num_generated ** self.params.length_penalty)
        for i in np.flatnonzero(c.ends[:width]):
            beam = self.beams[c.parent[i]]
            new.append(_Hypothesis(
                score=c.score[i] / denominator,
                token_ids=beam.seq.token_ids[beam.seq.num_prompt_tokens :] + [int(c.token[i])],
                logprobs=beam.logprobs + [(float(c.logprob[i]), int(c.rank[i]))],
                cum_logprob=c.score[i],
                finish_reason="stop" if int(c.token[i]) in self.eos else "length"))
        merged = self.hypotheses + new  # stable: an earlier hypothesis wins a tie
        merged.sort(key=lambda h: -h.score)
        self.hypotheses = merged[:width]

    def _finished(self, c: _Candidates) -> bool:
        """HF's stopping rule, after this step's hypotheses were added."""
        width, params = self.params.beam_width, self.params
        running = c.score[~c.ends]
        if len(self.hypotheses) == width:
            if self.early_stopping is True:
                return True
            if self.early_stopping == "never" and params.length_penalty > 0:
                best_len = params.max_tokens
            else:
                best_len = self._num_generated
            best = (running[0] if len(running) else np.float32(-1e9)) / np.float32(
                best_len ** params.length_penalty)
            self.improvable = self.improvable and bool(
                best > min(h.score for h in self.hypotheses))
        return not self.improvable or bool(c.ends.all())

    def _advance(self, c: _Candidates) -> None:
        """The best beam_width continuations that go on become the beams: a parent continues
        itself once and forks for its other continuations; unchosen parents are dropped."""
        chosen = np.flatnonzero(~c.ends)[: self.params.beam_width]
        continued: set[int] = set()
        beams = []
        for i in chosen:  # fork before any parent gets its own new token
            parent = self.beams[c.parent[i]]
            if c.parent[i] in continued:
                self._num_forks += 1
                seq = self.context.fork(parent.seq, self._num_forks)
            else:
                continued.add(c.parent[i])
                seq = parent.seq
            beams.append(_Beam(seq, c.score[i],
                               parent.logprobs + [(float(c.logprob[i]), int(c.rank[i]))]))
        for j, beam in enumerate(self.beams):
            if j not in continued:
                self.context.drop(beam.seq)
        scheduler = self.context.scheduler
        for beam, i in zip(beams, chosen):
            scheduler.append_tokens(beam.seq, [int(c.token[i])])
            scheduler.block_manager.cache_blocks(beam.seq.seq_id, beam.seq.token_ids,
                                                 beam.seq.num_computed_tokens)
            beam.seq.num_pending_forks = 0
        beams[0].seq.num_pending_forks = self.params.beam_width - len(beams)
        self.beams = beams

    def _finish(self) -> RequestOutput:
        for beam in self.beams:
            self.context.drop(beam.seq, "length")
        self.beams, self._done = [], True
        root = self.root
        token_texts = self._token_texts({t for h in self.hypotheses for t in h.token_ids})
        outputs = [self._completion(i, h, token_texts) for i, h in enumerate(self.hypotheses)]
        return RequestOutput(root.request_id, self.prompt,
                             root.token_ids[: root.num_prompt_tokens], outputs, finished=True,
                             num_cached_tokens=root.num_cached_tokens)

    def _token_texts(self, tokens: set[int]) -> dict[int, str]:
        """Each token's own text (its Logprob's decoded_token), one batched decode."""
        tokenizer = self.context.tokenizer
        if tokenizer is None:
            return dict.fromkeys(tokens, "")
        tokens = sorted(tokens)
        return dict(zip(tokens, tokenizer.batch_decode([[t] for t in tokens],
                                                       skip_special_tokens=True), strict=True))

    def _completion(self, index: int, hyp: _Hypothesis,
                    token_texts: dict[int, str]) -> CompletionOutput:
        tokenizer = self.context.tokenizer
        text = "" if tokenizer is None else tokenizer.decode(hyp.token_ids,
                                                             skip_special_tokens=True)
        logprobs = [{token: Logprob(lp, rank, token_texts[token])}
                    for token, (lp, rank) in zip(hyp.token_ids, hyp.logprobs)]
        return CompletionOutput(index=index, text=text, token_ids=hyp.token_ids,
                                cumulative_logprob=float(hyp.cum_logprob), logprobs=logprobs,
                                finish_reason=hyp.finish_reason)
