"""The closed set of step shapes an engine can run, known when it starts (NumPy-free, ints only).

Every step an engine runs has one of these `BatchLayout`s, so a backend compiles (JAX) or
captures (CUDA graphs) all of them before the first request and nothing while serving. Sampling
features (logprobs, penalties, logit_bias, filters, banned tokens, prompt logprobs, greedy and
seeded mixes) are fixed-size inputs with masks and in-graph branches: they never add a shape.

Two families, and a third with a draft model (vLLM's TPU runner pads num_tokens and num_reqs
the same way):
- decode: every sequence computes one token, T = S for S in the sequence buckets
  (1, 2, 4, ..., max_num_seqs rounded up to a power of two; from 16 on a GPU with jax, whose
  products of fewer rows are slow);
- mixed (prefill chunks, recomputes, anything else): T in the token buckets (16, 32, ...,
  max_num_batched_tokens rounded up) and S = min(T, the largest sequence bucket); with a draft
  the draft catches up on the same T rows in them (it proposes nothing there);
- with speculation, speculative decode steps: S in the sequence buckets, one shape per k in
  `spec_ks` (powers of two from 2 up to num_speculative_tokens, and it; the policy chooses
  among those only), T = S * (k + 1); the draft model runs in them, or, with drafts the host
  proposed (n-gram, suffix), only the target verifies them.

So the set holds |sequence buckets| * (1 + |spec_ks|) + |token buckets| shapes:
max_num_seqs, max_num_batched_tokens and num_speculative_tokens grow it (logarithmically),
max_model_len only widens the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

# The ks a speculative engine compiles besides its maximum: each k is one shape per batch bucket,
# and a speculative shape compiles in 3-5 s on a 2-core CPU (the demo pair's 7 batch buckets
# with ks 2 and 4 take about a minute more to start than without a draft).
SPEC_K_CANDIDATES = (2, 4, 8, 16)
MIN_MIXED_TOKENS = 16  # the smallest token bucket of a mixed step


def bucket(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, ..., up to the first power of two >= high."""
    out = [low]
    while out[-1] < high:
        out.append(2 * out[-1])
    return tuple(out)


@dataclass(frozen=True)
class BatchLayout:
    """The static shape of one step (hashable): a jit static argument for JAX, a CUDA-graph key
    for torch. See batch.py for the fields each shape holds."""

    num_tokens: int  # T
    num_seqs: int  # S: sequences, and logits rows (each samples once or verifies K drafts)
    max_blocks_per_seq: int  # M, fixed by max_model_len
    num_spec_tokens: int = 0  # K: drafts per sequence verified this step
    draft: bool = False  # the draft model runs: it catches up on T rows, then proposes K
    decode: bool = False  # every sequence has one query token and T == S (attention fast path)


@dataclass(frozen=True)
class StepShapes:
    """The shapes of one engine, from its configuration; `layouts()` enumerates them and the
    batch builder picks the smallest that fits each step."""

    seq_buckets: tuple[int, ...]  # S of decode and speculative decode steps
    token_buckets: tuple[int, ...]  # T of mixed steps
    spec_ks: tuple[int, ...]  # k of speculative decode steps; () without speculation
    max_blocks_per_seq: int  # M
    num_logit_entries: int  # E: (row, token) sampling entries a step carries (batch.py)
    # speculative steps run a draft model (False: the host proposes the drafts, e.g. n-gram)
    draft_model: bool = True

    @classmethod
    def for_engine(cls, *, max_num_seqs: int, max_num_batched_tokens: int,
                   max_blocks_per_seq: int, max_model_len: int,
                   num_speculative_tokens: int = 0, min_num_seqs: int = 1,
                   draft_model: bool = True) -> StepShapes:
        """min_num_seqs: the smallest sequence bucket (a power of two; the backend's
        `min_decode_rows`); it may exceed max_num_seqs, whose steps are then padding rows.
        draft_model: False where the drafts come from the host (no draft pass in any step)."""
        low = min(MIN_MIXED_TOKENS, bucket(max_num_batched_tokens))
        spec_ks = tuple(sorted({k for k in SPEC_K_CANDIDATES if k < num_speculative_tokens}
                               | ({num_speculative_tokens} if num_speculative_tokens else set())))
        return cls(seq_buckets=_powers_of_two(bucket(min_num_seqs), max_num_seqs),
                   token_buckets=_powers_of_two(low, max_num_batched_tokens),
                   spec_ks=spec_ks, max_blocks_per_seq=max_blocks_per_seq,
                   num_logit_entries=max(256, bucket(4 * max_model_len)),
                   draft_model=draft_model)

    @property
    def max_num_seqs(self) -> int:
        """The most sequences (and sample rows) a step may hold: the largest sequence bucket."""
        return self.seq_buckets[-1]

    def layouts(self) -> list[BatchLayout]:
        """Every shape, in a fixed order (cheap shapes first)."""
        out = [self.decode_layout(s) for s in self.seq_buckets]
        out += [self.mixed_layout(t) for t in self.token_buckets]
        out += [self.spec_layout(s, k) for k in self.spec_ks for s in self.seq_buckets]
        return out

    def decode_layout(self, num_seqs: int) -> BatchLayout:
        s = self.seq_bucket(num_seqs)
        return BatchLayout(s, s, self.max_blocks_per_seq, decode=True)

    def mixed_layout(self, num_tokens: int) -> BatchLayout:
        """T rows for num_tokens tokens (target's or draft's, whichever is more); as many
        sequences and sample rows as T, at most max_num_seqs; the draft catches up if any."""
        fits = [t for t in self.token_buckets if t >= num_tokens]
        if not fits:
            raise ValueError(f"{num_tokens} tokens exceed the largest step of "
                             f"{self.token_buckets[-1]}")
        t = fits[0]
        return BatchLayout(t, min(t, self.max_num_seqs), self.max_blocks_per_seq,
                           draft=bool(self.spec_ks) and self.draft_model)

    def spec_layout(self, num_seqs: int, k: int) -> BatchLayout:
        s, k = self.seq_bucket(num_seqs), self.spec_k(k)
        return BatchLayout(s * (k + 1), s, self.max_blocks_per_seq, num_spec_tokens=k,
                           draft=self.draft_model)

    def spec_k(self, k: int) -> int:
        """The smallest compiled k >= k (k >= 1)."""
        fits = [c for c in self.spec_ks if c >= k]
        if not fits:
            raise ValueError(f"k={k} exceeds the compiled ks {self.spec_ks}")
        return fits[0]

    def seq_bucket(self, num_seqs: int) -> int:
        """The smallest sequence bucket >= num_seqs."""
        fits = [s for s in self.seq_buckets if s >= num_seqs]
        if not fits:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs={self.max_num_seqs}")
        return fits[0]
