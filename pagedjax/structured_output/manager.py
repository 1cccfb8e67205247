"""StructuredOutputManager: one llguidance matcher per constrained completion, the step's token
bitmask, and the tokens a step may keep.

- A constrained request waits here, out of the scheduler, until its grammar is compiled (a
  worker thread); requests without one never wait for it.
- Each step the rows of constrained completions get their allowed tokens as a packed int32
  bitmask [rows, ceil(V / 32)] (bit t % 32 of word t // 32: token t allowed), filled by
  llguidance; the other rows allow everything. The samplers apply it on the
  device (a branch a step without constrained rows skips). Where the runner's other cores idle
  between steps, a step's rows are filled ahead (`fill_ahead`, mask_filler.py) as soon as the
  last step's tokens advance the matchers, and copied in once the step's input is built.
- With speculative decoding the mask is known for a row's first position only: the drafts, and
  the tokens the target verifies after them, come from the device in the same step. The
  matcher consumes the row's tokens in order and the row keeps them up to the first one the
  grammar forbids; the sequence rolls back to there like a rejected draft, and its next step
  samples that position again under the mask. Keeping a token only when it is allowed and
  otherwise drawing again from the masked distribution samples exactly that distribution, and a
  greedy row keeps exactly the masked argmax, so output equals decoding without drafts. A
  sampled row that drops tokens moves its random counter past the step's (`Sequence.rng_offset`),
  so the new draw is independent of the dropped one.
- A matcher that has finished its grammar ends its completion (finish_reason "stop").
- With a reasoning parser (`EngineConfig.reasoning_parser`, vLLM's), a completion reasons
  unconstrained and the grammar applies to the answer after it: from the token after the
  parser's end token (`</think>`), or from the first token where the prompt already closed
  the reasoning (a template that turned thinking off). Until then its rows allow every token.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedjax.core.batch import bitmask_width
from pagedjax.core.scheduler_output import SampledTokens
from pagedjax.core.sequence import Sequence
from pagedjax.sampling_params import SamplingParams
from pagedjax.structured_output.grammar import GrammarCompiler, grammar_key
from pagedjax.structured_output.mask_filler import FillJob, MaskFiller

if TYPE_CHECKING:
    from pagedjax.reasoning import ReasoningParser

logger = logging.getLogger(__name__)

# A step's rows are filled ahead (fill_ahead: on the filler thread, as soon as the last step's
# tokens advanced their matchers, while the engine thread builds that step's outputs and
# schedules this one) where a batch has at least AHEAD_MIN_ROWS of them: below that the
# hand-off costs more than it hides. Rows not filled ahead (a new request's first, a fork's) are
# filled on the engine thread, one after the other (tens of microseconds each), or by
# llguidance's thread pool for many rows on a machine with cores to spare: its idle workers
# spin, and on a 2-core CPU they took the cores from the model's own threads (SmolLM2, 20
# sampled JSON rows: 118 s with the pool, 7.1 s without); there its pool is one thread, the
# filler's.
AHEAD_MIN_ROWS = 4
PARALLEL_MASK_MIN_CORES = 8
PARALLEL_MASK_ROWS = 16


class StructuredOutputManager:
    def __init__(self, tokenizer: Any | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...],
                 reasoner: ReasoningParser | None = None) -> None:
        """reasoner: the engine's reasoning parser (its end marker one token); None: no
        reasoning."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._reasoner = reasoner
        self._thinking: set[int] = set()  # seq ids still reasoning: their grammar waits
        self.width = bitmask_width(vocab_size)
        self._eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None  # on the first constrained request
        self._parallel = False  # fill many rows on llguidance's pool (a machine with cores spare)
        self._filler: MaskFiller | None = None  # fills the next step's rows ahead
        self._ahead: tuple[dict[int, int], FillJob] | None = None  # seq id → row, the job
        # (row of the step's mask, row filled ahead, its sequence): for finish_bitmask
        self._pending: list[tuple[int, int, Sequence]] = []
        self._waiting: list[tuple[Sequence, Future]] = []  # grammar not compiled yet
        self._grammars: dict[str, Any] = {}  # request id → its compiled (unused) matcher
        # seq id → (the completion, its matcher: advanced with its tokens)
        self._matchers: dict[int, tuple[Sequence, Any]] = {}
        self._request_seqs: dict[str, set[int]] = {}  # request id → seq ids with a matcher
        self._failed: set[int] = set()  # seq ids that sampled outside their grammar
        self.num_requests_total = 0
        self.num_tokens_rejected = 0  # tokens of speculative rows cut because a grammar forbade

    # ---- requests ----------------------------------------------------------------------------

    def check(self, params: SamplingParams) -> str:
        """The request's grammar; raises ValueError naming what is wrong (called when a
        request is added, before anything is queued)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model "
                             "directory ships none.")
        return grammar_key(params.structured_outputs)

    def add_request(self, seq: Sequence, grammar: str) -> None:
        """Hold seq (a new request's first completion) until its grammar is compiled."""
        if self._compiler is None:
            import llguidance

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             self._eos_token_ids)
            cores = os.cpu_count() or 1
            self._parallel = cores >= PARALLEL_MASK_MIN_CORES
            self._filler = MaskFiller(llguidance.LLExecutor(
                num_threads=cores // 4 if self._parallel else 1))
        self.num_requests_total += 1
        self._waiting.append((seq, self._compiler.compile(grammar)))

    def take_ready(self) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """(sequences whose grammar is now compiled, to schedule; (sequence, error) for those
        whose grammar failed). Aborted ones are dropped."""
        ready, failed, still = [], [], []
        for seq, future in self._waiting:
            if seq.is_finished:
                continue
            if not future.done():
                still.append((seq, future))
            elif future.exception() is not None:
                failed.append((seq, future.exception()))
            else:
                self._grammars[seq.request_id] = future.result()
                self._matcher(seq)
                ready.append(seq)
        self._waiting = still
        return ready, failed

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    @property
    def has_matchers(self) -> bool:
        """Whether some constrained completion is live (or finished and not released yet)."""
        return bool(self._matchers)

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar is compiled, or timeout seconds."""
        wait([f for _, f in self._waiting], timeout=timeout, return_when=FIRST_COMPLETED)

    def release(self) -> None:
        """Forget finished (or aborted) completions' matchers, and a request's grammar with its
        last one."""
        for seq_id, (seq, _) in list(self._matchers.items()):
            if seq.is_finished:
                del self._matchers[seq_id]
                self._failed.discard(seq_id)
                self._thinking.discard(seq_id)
                live = self._request_seqs[seq.request_id]
                live.discard(seq_id)
                if not live:
                    del self._request_seqs[seq.request_id]
                    self._grammars.pop(seq.request_id, None)

    # ---- steps -------------------------------------------------------------------------------

    def is_constrained(self, seq: Sequence) -> bool:
        return seq.sampling_params.structured_outputs is not None

    def _matcher(self, seq: Sequence) -> Any:
        """seq's matcher; a completion met for the first time (the first, or an n > 1 sibling
        forked off it) starts from its request's grammar, past any output it already has."""
        entry = self._matchers.get(seq.seq_id)
        if entry is not None:
            return entry[1]
        matcher = self._grammars[seq.request_id].deep_copy()
        output = seq.token_ids[seq.num_prompt_tokens :]
        if self._reasoner is not None:
            answer_start = self._answer_start(seq)
            if answer_start is None:
                self._thinking.add(seq.seq_id)
                output = []
            else:
                output = output[answer_start:]
        if output and not matcher.consume_tokens(output):
            logger.warning("completion %d's output is outside its grammar: %s", seq.seq_id,
                           matcher.get_error())
        self._matchers[seq.seq_id] = (seq, matcher)
        self._request_seqs.setdefault(seq.request_id, set()).add(seq.seq_id)
        return matcher

    def _answer_start(self, seq: Sequence) -> int | None:
        """Where seq's answer starts in its output (past the reasoning); None while it is
        still reasoning. A prompt whose last end marker follows its last start marker has
        closed the reasoning itself (0)."""
        if self._reasoner.is_reasoning_end(seq.token_ids[: seq.num_prompt_tokens]):
            return 0
        end_id = self._reasoner.end_token_id
        output = seq.token_ids[seq.num_prompt_tokens :]
        return output.index(end_id) + 1 if end_id in output else None

    def bitmask(self, seqs: list[Sequence]) -> np.ndarray | None:
        """[len(seqs), W] int32 allowed tokens of a step's sample rows (-1: all, for rows
        without a constraint); None if no row has one. Rows being filled ahead are left for
        `finish_bitmask`, which the step must call on the mask it uploads (this one, or the
        padded copy of it) before the device reads it: the fill ahead runs on meanwhile."""
        ahead_rows = self._ahead[0] if self._ahead is not None else {}
        rows, pending, mask = [], [], None
        for r, seq in enumerate(seqs):
            if not self.is_constrained(seq):
                continue
            if mask is None:  # (a step with a reasoning row is constrained too: accept
                # must see its tokens, and the next step's mask depends on them)
                mask = np.full((len(seqs), self.width), -1, np.int32)
            matcher = self._matcher(seq)
            if seq.seq_id in self._thinking:
                continue  # still reasoning: its row allows every token
            row = ahead_rows.get(seq.seq_id)
            if row is not None:
                pending.append((r, row, seq))
            else:
                rows.append((matcher, r))
        self._pending = pending
        if mask is None:
            self._take_ahead()  # no constrained row this step: the rows filled ahead are stale
            return None
        if rows:
            self._fill(rows, mask)
        return mask

    def finish_bitmask(self, mask: np.ndarray) -> None:
        """Copy the rows filled ahead into a step's mask (bitmask's, or its padded copy: the
        same row order), waiting for the fill if it is still running."""
        pending, self._pending = self._pending, []
        filled = self._take_ahead()
        if not pending:
            return
        if filled is None:  # the fill ahead failed: those rows are filled here
            self._fill([(self._matcher(seq), r) for r, _, seq in pending], mask)
            return
        mask[[r for r, _, _ in pending]] = filled[[row for _, row, _ in pending]]

    def _fill(self, rows: list[tuple[Any, int]], mask: np.ndarray) -> None:
        """Fill rows (matcher, row of mask) of mask on the engine thread."""
        row_bytes = mask.strides[0]
        if self._parallel and len(rows) >= PARALLEL_MASK_ROWS:
            self._filler.executor.unsafe_compute_mask_ptr(rows, mask.ctypes.data, row_bytes,
                                                          len(mask))
            return
        # llguidance's own writer into the row's address (its NumPy wrapper's per-row view and
        # ctypes lookup cost ~7 µs a row: a quarter of a batch-32 step's fill here)
        base = mask.ctypes.data
        for matcher, r in rows:
            matcher.unsafe_compute_mask_ptr(base + r * row_bytes, row_bytes)

    def fill_ahead(self, seqs: list[Sequence]) -> None:
        """Start filling the next step's mask rows of seqs, whose matchers a step just advanced
        (`accept`; after `stopped`), on the filler thread: the engine thread builds this step's
        outputs and schedules and prepares the next one meanwhile, and `finish_bitmask` takes
        the rows. Until then nothing else calls those matchers."""
        live = [(seq.seq_id, entry[1]) for seq in seqs
                if not seq.is_finished and (entry := self._matchers.get(seq.seq_id))
                and seq.seq_id not in self._thinking]
        if len(live) < AHEAD_MIN_ROWS or self._filler is None:
            return
        self._take_ahead()  # a job not taken (no step since): its rows are stale
        job = self._filler.submit([matcher for _, matcher in live], self.width)
        self._ahead = ({seq_id: row for row, (seq_id, _) in enumerate(live)}, job)

    def _take_ahead(self) -> np.ndarray | None:
        """The rows of the fill ahead once it is done; None if there is none, or it failed
        (the caller fills what it needs again)."""
        if self._ahead is None:
            return None
        job, self._ahead = self._ahead[1], None
        mask = job.wait()
        if mask is None:
            logger.warning("filling token masks ahead failed (%s); filling them again",
                           job.error)
        return mask

    def accept(self, seqs: dict[int, Sequence], sampled: SampledTokens,
               num_spec_tokens: int) -> list[Sequence]:
        """Advance the matchers of a step's constrained rows by the tokens they produced, each
        row cut at the first token its grammar forbids (only a row with drafts can hold one;
        `sampled` is cut in place). Returns the sequences cut: their random counter moved."""
        cut = []
        for r, seq_id in enumerate(sampled.seq_ids):
            seq = seqs.get(seq_id)
            if (seq is None or seq.is_finished or not self.is_constrained(seq)
                    or seq.policy_picks_tokens):
                continue
            matcher = self._matcher(seq)
            tokens = sampled.tokens(r)
            num_free = 0  # tokens of the reasoning, before the grammar applies
            if seq_id in self._thinking:
                end_id = self._reasoner.end_token_id
                if end_id not in tokens:
                    continue
                self._thinking.discard(seq_id)
                num_free = tokens.index(end_id) + 1
                tokens = tokens[num_free:]
                if not tokens:
                    continue
            if len(tokens) == 1 and not num_free:  # sampled under the mask: the cheaper call
                num_kept = int(matcher.consume_token(tokens[0]))
            else:
                num_kept = matcher.try_consume_tokens(tokens)
            if num_kept == len(tokens):
                continue
            if num_kept == 0 and not num_free:  # sampled under the mask: never here
                logger.warning("completion %d sampled token %d outside its grammar (%s); it "
                               "stops", seq_id, tokens[0], matcher.get_error())
                num_kept = 1
                self._failed.add(seq_id)
            self.num_tokens_rejected += len(tokens) - num_kept
            if sampled.num_tokens is not None:  # a row of one token is never cut
                sampled.num_tokens[r] = num_free + num_kept
            if not seq.sampling_params.is_greedy:
                seq.rng_offset += num_spec_tokens + 1  # past every counter the step used
            cut.append(seq)
        return cut

    def stopped(self, seqs: list[Sequence]) -> list[Sequence]:
        """The running constrained sequences whose grammar has finished (or failed): the
        engine ends them."""
        out = []
        for seq in seqs:
            entry = self._matchers.get(seq.seq_id)
            if entry is not None and not seq.is_finished and (
                    entry[1].is_stopped() or seq.seq_id in self._failed):
                out.append(seq)
        return out

    # ---- metrics -----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        compiler = self._compiler
        return {
            "structured_output_requests_total": self.num_requests_total,
            "structured_output_tokens_rejected_total": self.num_tokens_rejected,
            "grammar_compiles_total": compiler.num_compiles if compiler else 0,
            "grammar_compile_seconds_total": compiler.compile_seconds_total if compiler else 0.0,
        }

    def shutdown(self) -> None:
        self._take_ahead()
        if self._filler is not None:
            self._filler.shutdown()
        if self._compiler is not None:
            self._compiler.shutdown()

