"""How many drafts a speculative step proposes: k among 0 and the compiled ks (step_shapes.py),
learned from what the engine achieves.

The policy picks the k with the most expected tokens per second, E(k) / t(k):
- E(k) = 1 + sum_{j<k} c_j a_j, the tokens per sequence a step with k drafts yields, a_j the
  measured chance that the first j + 1 drafts are accepted (each position forgetting draft by
  draft as it is drafted again; one never drafted counts as the last measured one, 1 before
  any), c_j the share of a verifying step's sequences that proposed a (j + 1)-th draft: 1
  with a draft model, which drafts for every sequence; with drafts the host proposes (n-gram,
  suffix) only the sequences whose tokens match propose, and the rest yield one token in the
  step (SmolLM2 on the code-editing set at batch 16: a quarter of them, so E(4) was 2.8 where
  the verifying steps yielded 1.5 tokens a sequence, and drafting, whose steps cost 2.5 times
  k = 0's there, ran at 0.8x no speculation). A step where none proposes runs k = 0's shape,
  so at batch 1 c_j counts only the lengths of the proposals;
- with host drafts, a step offered k drafts verifies only where some sequence matches (p = 1 -
  (1 - m)^S for S sequences, m the measured share of sequences that propose, ShadowDrafts
  measuring it while drafting is off), and otherwise runs k = 0's shape synchronously (its
  drafts need the last step's tokens) in t_sync, measured apart from t(0), whose steps may
  launch ahead: offering k yields (p E(k) + 1 - p) / (p t(k) + (1 - p) t_sync) (_rate);
- t(k) the step's seconds at this batch bucket, as the engine measures them step by step (the
  period between two decode steps' outputs: host and device work alike; with a draft model,
  only steps where every sequence drafted k: see observe). The startup table
  (measure_step_costs: one context, synthetic batches, the runner alone) only stands in for a
  (bucket, k) the engine has not run yet, times what the engine's steps with the same k at
  other buckets showed of the table's error (the geometric mean of measured / table; none
  before any). Once measured, a cell's own steps are its estimate: the table's error varies
  by bucket and by k alike (the demo pair on jax, batch 32 at a context of ~100: t(0) 0.6x the
  table, t(2) 0.8x; at batch 1, t(0) 1.4x), so no correction of it decides for long. A k > 0's
  estimate moves with its bucket's t(0) since it was measured (_drift).

A k never measured at this bucket is tried there, at most once every EXPLORE_EVERY steps and
EXPLORE_TRIES times (a try in a step that holds a prompt chunk measures nothing, and a new
batch's prompts come first, at its bucket), k = 0 first: the reference every k > 0 must beat.
So a new bucket's estimates are its own within a few steps (a batch of 32 lasts ~30).
Every PROBE_EVERY steps the policy runs the k measured or probed longest ago at this bucket
instead (a k > 0 before 0 where they tie, the better rate first; not the least measured: a k
measured often on other, longer prompts kept a stale time that no probe refreshed; nor only
measured: host drafts offered k where none matched measure no t(k), and the probes went to
that k again and again, never to k = 0; while it drafts
nothing at the bucket, the smallest compiled k: whether drafting pays again, at the cheapest
drafting step's price), measuring its time and, drafting, the acceptance of its positions:
a change in the prompts or the host's speed is found, at a cost of at most one step in
PROBE_EVERY (a cell's old measurements fading with the steps run since, AGE_DECAY). While it
drafts, a probe is only for a k that would beat the choice were its rate PROBE_OPTIMISM times
what the estimates say, one not measured in STALE_AFTER steps, or one timed by fewer than
PROBE_MIN_SAMPLES steps at the bucket (its first steps run slow: RESULTS.md, stop 71). A probe
of k = 0 where k = 4 yields ~4.8 tokens a step costs ~4 tokens, and with a draft model the step
after it only catches the draft up (the demo pair on jax, the repeat set at batch 1: probes and
catch-ups in 56 of ~900 steps, 0.92x fixed k = 4).
Otherwise a k > 0 must promise MIN_GAIN over k = 0 (a step's time varies with context length
and batch fill).

A draft model falls behind in k = 0 steps (it runs only in speculative shapes), and a sequence
drafts only where it can catch up on k + 1 tokens (Scheduler._num_spec_tokens): a probe after a
k = 0 streak would pay a speculative shape that catches up and measures no acceptance. So with a
draft model a due probe waits for a step where some sequence's draft is current (a prompt just
computed, the draft catching up with it, or drafts just verified) — at most FORCE_PROBE_AFTER
steps, then it runs anyway. Drafts the host proposes (n-gram, suffix) never fall behind.

While its choice outside probes is k = 0 (`drafts_pay` False), a draft model's prefill of a new
prompt would buy nothing: the scheduler then catches the draft up on sentinel sequences' prompts
only (Scheduler._catches_up), which keep the probes' acceptance measured.
"""

from __future__ import annotations

import math

import numpy as np

from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput
from pagedjax.core.spec_decode import (
    SpecDecodeMetrics,
    SpeculativeConfig,
    StepCosts,
    verified_drafts,
)
from pagedjax.core.step_shapes import StepShapes


class AdaptiveSpeculation:
    """choose(num_seqs) → k for the next step; observe(out, sampled, seconds) after it."""

    ACCEPTANCE_DECAY = 0.95  # per draft at a position: its last ~20 drafts count
    COVERAGE_DECAY = 0.9  # host drafts' share proposing, per verifying step: its last ~10 count
    TIME_DECAY = 0.9  # per measured step of a cell: its last ~10 steps count,
    AGE_DECAY = 0.99  # and per step the engine ran since (one 100 steps old counts a third)
    # a period over this many times its cell's measured estimate is an idle gap: dropped (over
    # its square times the table's, in a cell not measured yet: the table may be far off)
    OUTLIER = 4.0
    MIN_GAIN = 1.03
    EXPLORE_EVERY = 4  # a k not yet measured at this bucket is tried at most this often,
    EXPLORE_TRIES = 8  # and at most this many times
    PROBE_EVERY = 32  # every this many steps, the k measured longest ago
    FORCE_PROBE_AFTER = 4 * PROBE_EVERY  # a probe waiting for a current draft runs anyway
    # while drafting, a probe is for a k whose rate this much higher would beat the choice,
    # or one not measured in STALE_AFTER steps
    PROBE_OPTIMISM = 1.25
    STALE_AFTER = 4 * PROBE_EVERY
    PROBE_MIN_SAMPLES = 3  # or one timed by fewer steps: a bucket's first ones may be slow
    # with steps launched ahead (`chains`): a probe or try's steps after its own (the first
    # untimed, then a pair timed; one more where a draft model's probe caught up first), and
    # the steps whose periods make one sample
    CHAIN = 4
    PAIR = 2

    def __init__(self, config: SpeculativeConfig, shapes: StepShapes,
                 costs: StepCosts | None) -> None:
        self.max_k = config.num_speculative_tokens
        self.adaptive = config.adaptive and costs is not None  # no table: k stays fixed
        self.shapes, self.costs = shapes, costs
        self.metrics = SpecDecodeMetrics(self.max_k)
        self.k = self.max_k  # the latest choice
        self.steps_per_k = [0] * (self.max_k + 1)  # steps run with each k
        self._drafted = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k
        # host drafts, per position j: decayed sequences of the steps that verified a (j + 1)-th
        # draft, and those of them that proposed one
        self._verifying = [0.0] * self.max_k
        self._proposing = [0.0] * self.max_k
        # host drafts: decayed (decoding sequences offered drafts that proposed some, those
        # offered), from steps offered drafts and from ShadowDrafts' picks
        self._matching = (0.0, 0.0)
        # host drafts, bucket → decayed (seconds, weight) of the steps offered drafts where none
        # proposed (k = 0's shape, run synchronously)
        self._unmatched: dict[int, tuple[float, float]] = {}
        self._since_probe = 0  # steps since the last probe
        self._since_explore = 0  # steps since the last try of a k not yet measured at its bucket
        self._exploring = False  # the latest choice was one
        self._tries: dict[tuple[int, int], int] = {}  # (bucket, k) → its tries
        self._probing = False  # the latest choice was a probe
        self._chosen = self.max_k  # the latest step's choice outside a probe, at its bucket
        # steps since one that left some sequence's draft current (a draft model's lag)
        self._steps_since_current = 0
        # (bucket, k) → decayed (sum of measured seconds, their weight)
        self._measured: dict[tuple[int, int], tuple[float, float]] = {}
        # (bucket, k > 0) → the bucket's measured t(0) when that cell was last measured
        self._t0_then: dict[tuple[int, int], float] = {}
        self._num_observed = 0  # steps observed
        self._last_measured: dict[tuple[int, int], int] = {}  # (bucket, k) → its last step's index
        self._last_run: dict[tuple[int, int], int] = {}  # and of its last timed step, probe or try
        self._num_samples: dict[tuple[int, int], int] = {}  # (bucket, k) → its steps timed
        # k → decayed (sum of log(measured / table) over its cells, weight)
        self._log_error: dict[int, tuple[float, float]] = {}
        # Set by the engine where speculative steps launch ahead (async speculation, as plain
        # ones do): a step that waited for the last one's tokens costs the host's work beside
        # the device's, one launched ahead about the device's alone. Each k is then timed only
        # by steps launched ahead after a step launched ahead (the first one after a step that
        # waited had its device time overlap that step's wait: 0.1 ms where k = 0 takes 1.2),
        # PAIR at a time (their periods alternate around the mean: 0.5, 1.1, 2.0 ms), and a
        # probe or a try runs CHAIN more steps of its k, launched ahead where they can, to be
        # timed so (probes come as much less often: _probe_every). Timed as they ran, a probe
        # (which waits) made every k but the one chosen look slow, and the choice stuck (the
        # demo pair on jax, chat turns at batch 1: k = 2 in 1324 of 1400 steps where k = 4 ran
        # 1.39x faster).
        self.chains = False
        # Set by the engine where k = 0 steps launch ahead and the host proposes the drafts
        # (async scheduling with n-gram or suffix drafts, whose verifying steps wait for the
        # last step's tokens): t(0) is timed only by k = 0 steps launched ahead after one
        # launched ahead, PAIR at a time, and a probe or try of k = 0 runs CHAIN more k = 0
        # steps to be timed so; verifying steps are timed as they run. A k = 0 probe after a
        # verifying step waits for its tokens: timed so, t(0) read 4.2-4.6 ms where k = 0 steps
        # launched ahead take 2.9 (the demo target, chat turns at batch 16), and drafting,
        # 0.93x no speculation, looked 1.2-1.8x faster.
        self.zero_ahead = False
        self._chain_left = 0  # steps of the latest probe or try's k still to launch ahead
        self._pair: tuple[tuple[int, int], float, int] | None = None  # (cell, seconds, steps)
        self._last_ahead = False  # the last step observed was launched ahead

    # ---- choosing ------------------------------------------------------------------------

    def choose(self, num_seqs: int) -> int:
        """k for a step that will run about num_seqs sequences."""
        if not self.adaptive:
            self.k = self.max_k
            return self.k
        if self._chain_left:  # a probe or try's steps, where they could not launch ahead (a
            return self.k  # draft model's probe after k = 0 steps catches up first)
        bucket = self.shapes.seq_bucket(num_seqs)
        rate = {k: self._rate(bucket, num_seqs, k) for k in (0, *self.shapes.spec_ks)}
        best = max(self.shapes.spec_ks, key=rate.__getitem__)
        if rate[best] < self.MIN_GAIN * rate[0]:
            best = 0
        # this bucket's choice outside probes, even in one: a batch of a new size arrives in
        # a step that tries a k there, and drafts_pay decides whether its prompts' drafts are
        # prefilled (the last bucket's choice would decide it)
        self._chosen = best
        untried = self._untried(bucket)
        self._exploring = self._explore_due(untried)
        self._probing = self._exploring or self._probe_due()
        if self._exploring:
            best = min(untried, key=lambda k: (k > 0, -rate[k]))  # k = 0: the reference
            self._tries[bucket, best] = self._tries.get((bucket, best), 0) + 1
        elif self._probing and not self._chosen:  # drafting is off here: whether it pays
            best = min(self.shapes.spec_ks)  # again, at the cheapest drafting step's price
        elif self._probing:  # the k run longest ago at this bucket, of those worth it
            last = {k: self._last_run.get((bucket, k), -1) for k in rate}
            worth = [k for k in rate if rate[k] * self.PROBE_OPTIMISM >= rate[self._chosen]
                     or self._num_observed - self._last_measured.get((bucket, k), -1)
                     >= self.STALE_AFTER
                     or self._num_samples.get((bucket, k), 0) < self.PROBE_MIN_SAMPLES]
            best = min(worth, key=lambda k: (last[k], k == 0, -rate[k]))
        self._chain_left = self.CHAIN if self._probing and (
            self.chains or (self.zero_ahead and best == 0)) else 0
        self.k = best
        return best

    def next_k_is_zero(self, num_seqs: int) -> bool:
        """Whether the step after the one in flight (of num_seqs sequences) runs k = 0 whatever
        that one yields, before observe() has seen it (next_k_is)."""
        return self.next_k_is(0, num_seqs)

    def next_k_is(self, k: int, num_seqs: int) -> bool:
        """Whether the step after the one in flight (of num_seqs sequences) runs k whatever
        that one yields, before observe() has seen it: k is the choice outside probes (or the
        fixed k) and neither a probe nor a try of a k at this bucket is due within two steps.
        Async scheduling then launches it without choose() (the engine's overlap.py); observe()
        still sees it, and the next probe ends the run."""
        if not self.adaptive:
            return k == self.max_k
        if self._chain_left:  # a probe or try's steps, launched ahead to be timed
            return k == self.k
        if self._chosen != k:
            return False
        ahead = 1  # the step in flight, not observed yet
        return not (self._probe_due(ahead)
                    or self._explore_due(self._untried(self.shapes.seq_bucket(num_seqs)), ahead))

    def next_k(self, num_seqs: int) -> int | None:
        """The k of the step after the one in flight (of num_seqs sequences) whatever that one
        yields (next_k_is); None where it depends on it (a probe or try due, or the choice
        made by choose() after it)."""
        if not self.adaptive:
            return self.max_k
        k = self.k if self._chain_left else self._chosen
        return k if self.next_k_is(k, num_seqs) else None

    def _untried(self, bucket: int) -> list[int]:
        """The ks not measured at this bucket with tries left (none while nothing is timed; a
        k > 0 only where some sequence's draft is current, as for a probe)."""
        if not self._measured:
            return []
        drafts = self._drafts_current()
        return [k for k in (0, *self.shapes.spec_ks) if (bucket, k) not in self._measured
                and self._tries.get((bucket, k), 0) < self.EXPLORE_TRIES and (drafts or not k)]

    def _explore_due(self, untried: list[int], ahead: int = 0) -> bool:
        """Some k is untried at the bucket and EXPLORE_EVERY steps passed since the last try
        (ahead: steps not observed yet)."""
        return bool(untried) and self._since_explore + 1 + ahead >= self.EXPLORE_EVERY

    def _drafts_current(self) -> bool:
        """Whether some sequence can draft at the smallest compiled k (always, without a
        draft model)."""
        return (not self.shapes.draft_model
                or self._steps_since_current <= min(self.shapes.spec_ks))

    @property
    def drafts_pay(self) -> bool:
        """Whether the latest step's choice outside a probe, at its bucket, drafted (True
        before any, and with a fixed k)."""
        return not self.adaptive or self._chosen > 0

    @property
    def _probe_every(self) -> int:
        """Steps between probes: PROBE_EVERY, and as much again per two steps a probe chains
        (`chains`: a probe costs 1 + CHAIN steps of its k, not 1)."""
        return self.PROBE_EVERY * (1 + self.CHAIN) // 2 if self.chains else self.PROBE_EVERY

    def _probe_due(self, ahead: int = 0) -> bool:
        """PROBE_EVERY steps since the last probe, and (a draft model) some sequence can draft
        at the smallest compiled k, or the probe has waited FORCE_PROBE_AFTER steps. ahead: k = 0
        decode steps not observed yet (they only make drafts less current)."""
        since = self._since_probe + 1 + ahead
        if since < self._probe_every:
            return False
        return self._drafts_current() or since >= self.FORCE_PROBE_AFTER

    def _rate(self, bucket: int, num_seqs: int, k: int) -> float:
        """Expected tokens per sequence and second when the next steps are offered k drafts.
        Host drafts: a step verifies only where some sequence matches (the chance p that one
        of num_seqs does), else it runs k = 0's shape, timed apart as t_sync: after a
        verifying step it waits for that step's tokens (the demo pair on jax at batch 1, 3.2 ms
        against 1.6 ms a k = 0 step), after a plain one it launches ahead with drafts proposed
        from the tokens before (overlap.py): (p E(k) + 1 - p) / (p t(k) + (1 - p) t_sync)."""
        tokens, seconds = self.expected_tokens(k), self.seconds(bucket, k)
        if k and not self.shapes.draft_model:
            matching, offered = self._matching
            p = 1.0 - (1.0 - matching / offered) ** num_seqs if offered else 1.0
            unmatched = self._unmatched.get(bucket)
            t_sync = unmatched[0] / unmatched[1] if unmatched else self.seconds(bucket, 0)
            tokens, seconds = p * tokens + 1.0 - p, p * seconds + (1.0 - p) * t_sync
        return tokens / seconds

    def expected_tokens(self, k: int) -> float:
        """Tokens per sequence and step with k drafts: 1 + sum_{j<k} P(a (j + 1)-th draft
        proposed) P(first j + 1 accepted)."""
        total, rate, coverage = 1.0, 1.0, 1.0
        for j in range(k):  # unmeasured positions: as the last measured one
            if self._drafted[j] > 0:
                rate = self._accepted[j] / self._drafted[j]
            if self._verifying[j] > 0:
                coverage = self._proposing[j] / self._verifying[j]
            total += coverage * rate
        return total

    def seconds(self, bucket: int, k: int) -> float:
        """The estimate of t(k) at this bucket: the decayed mean of this cell's measured steps,
        for k > 0 scaled by how t(0) at the bucket moved since the cell was last measured;
        before any, the table's, corrected by the error this k's measured cells showed."""
        mean = self._mean(bucket, k)
        if mean is not None:
            return mean * self._drift(bucket, k)
        error_sum, error_weight = self._log_error.get(k, (0.0, 0.0))
        return self.costs[bucket][k] * math.exp(error_sum / error_weight if error_weight else 0.0)

    def _drift(self, bucket: int, k: int) -> float:
        """t(0)'s measured estimate at the bucket now ÷ when (bucket, k > 0) was last measured
        (1 for k = 0, or without both). A step's time moves with its context length (and the
        host's speed) alike for every k, and a k > 0 is measured only where it runs: while the
        policy drafts nothing, a draft model's probes, drafted by the sentinels alone, are no
        samples (observe), so a time measured on longer prompts would decide on shorter ones
        (the demo pair on jax, batch 32: t(4) 40 ms measured on code, 28-30 ms on chat turns,
        where k = 0 runs in 8.5 ms against 12.8)."""
        then, now = self._t0_then.get((bucket, k)), self._mean(bucket, 0)
        return now / then if then and now else 1.0

    def _mean(self, bucket: int, k: int) -> float | None:
        """The decayed mean of the cell's measured steps (None before any)."""
        total, weight = self._measured.get((bucket, k), (0.0, 0.0))
        return total / weight if weight else None

    # ---- learning ------------------------------------------------------------------------

    def observe(self, out: SchedulerOutput, sampled: SampledTokens,
                seconds: float | None = None, shape_k: int | None = None,
                launched_ahead: bool = False) -> None:
        """Record a step: how many of its drafts were accepted, per position, and (seconds) the
        engine's period for it, where every sequence decoded one token (a step with a prompt
        chunk is no sample of t(k)) and, with a draft model, proposed its shape's k drafts.
        shape_k: the k of the shape the step ran (None: the drafts it proposed). A draft
        model's speculative shape where some sequence proposed fewer (the draft only caught up
        after k = 0 steps, a sequence near its end) is no sample of any t: it costs less than a
        step where every sequence drafts (RESULTS.md, stop 65), and taken for t(shape_k) beside
        E(k), which counts drafted positions only, it made drafting look cheaper than it is;
        counted as t(0) it made k = 0 look slow.
        Host drafts verify in their shape whoever proposed: a verifying step is a sample of
        t(shape_k) and of how many of its sequences propose each position (E(k)); a step
        offered drafts where nobody proposed ran k = 0's shape synchronously, a sample of
        t_sync and not of t(0) (_rate)."""
        self.steps_per_k[out.num_spec_tokens] += 1
        k = out.num_spec_tokens if shape_k is None else shape_k
        if self.chains or self.zero_ahead:  # the step after this one is launched already
            self._chain_left = max(0, self._chain_left - 1)
            if self.chains or not (self.k or k):  # zero_ahead: k = 0 steps as chains time
                seconds = self._paired(out, seconds, launched_ahead, k)  # them; verifying
            else:  # ones as they ran
                self._last_ahead, self._pair = launched_ahead, None
        self._observe_acceptance(out, sampled)
        decode = bool(out.seq_ids) and max(out.num_new_tokens) == 1
        # a probe counts where it ran as a decode step (a prompt's step proposes nothing)
        self._since_probe = 0 if self._probing and decode else self._since_probe + 1
        bucket = self.shapes.seq_bucket(len(out.seq_ids))
        if self._probing and decode:
            self._last_run[bucket, self.k] = self._num_observed
        self._since_explore = 0 if self._exploring else self._since_explore + 1
        self._probing = self._exploring = False
        if out.num_spec_tokens or any(out.num_draft_tokens):
            self._steps_since_current = 0  # drafts verified, or a draft caught up
        else:
            self._steps_since_current += 1
        offered = self.k  # the step's choice: observe follows choose, or runs ahead at k = 0
        if not self.shapes.draft_model and decode and offered:
            self.observe_matching(len(out.seq_ids), int(np.count_nonzero(
                out.num_spec_tokens_per_seq)))
            if k:
                self._observe_coverage(len(out.seq_ids), out.num_spec_tokens_per_seq, k)
            else:  # nobody matched: no sample of t(0), whose steps may run ahead
                if self.adaptive and seconds is not None and seconds > 0:
                    self._observe_unmatched(bucket, seconds)
                seconds = None
        if self.adaptive and seconds is not None and seconds > 0 and decode and (
                not self.shapes.draft_model
                or (k == 0 and not any(out.num_draft_tokens))  # not a draft's catch-up step
                or (k and min(out.num_spec_tokens_per_seq, default=0) == k)):  # all drafted k
            self._observe_seconds(bucket, k, seconds)
        self._num_observed += 1

    def _paired(self, out: SchedulerOutput, seconds: float | None, launched_ahead: bool,
                k: int) -> float | None:
        """`chains`: the mean period of PAIR steps of one k (the step's shape) at one bucket,
        each launched ahead after a step launched ahead, once the pair is complete; else None
        (no sample)."""
        steady, self._last_ahead = launched_ahead and self._last_ahead, launched_ahead
        cell = (self.shapes.seq_bucket(len(out.seq_ids)), k)
        if not steady or seconds is None:
            self._pair = None
            return None
        if self._pair is None or self._pair[0] != cell:
            self._pair = (cell, 0.0, 0)
        _, total, steps = self._pair
        total, steps = total + seconds, steps + 1
        self._pair = None if steps == self.PAIR else (cell, total, steps)
        return total / steps if steps == self.PAIR else None

    def _observe_acceptance(self, out: SchedulerOutput, sampled: SampledTokens) -> None:
        # each position forgets only when it is drafted again (one rarely drafted, a larger k
        # than usual, keeps its earlier measurements), and by the draft, not by the step: a
        # batch-32 step's drafts weigh 32 times a batch-1 step's, and a probe drafted by a few
        # sentinels moves an estimate that many full steps made as much as their drafts do
        for num_drafts, num_accepted in verified_drafts(out, sampled):
            self.metrics.record(num_drafts, num_accepted)
            self.observe_drafts(num_drafts, num_accepted)

    def observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's drafts and how many of them were accepted: verified, or (host
        drafts while drafting is off: host_drafts.ShadowDrafts) scored against the tokens
        it decoded without them."""
        decay = self.ACCEPTANCE_DECAY
        for j in range(num_drafts):
            self._drafted[j] = self._drafted[j] * decay + 1
            self._accepted[j] = self._accepted[j] * decay + (j < num_accepted)

    def observe_matching(self, num_offered: int, num_proposing: int) -> None:
        """Host drafts: of num_offered decoding sequences offered drafts (a step's, or
        ShadowDrafts' picks while drafting is off), num_proposing proposed some."""
        matching, offered = self._matching
        decay = self.COVERAGE_DECAY
        self._matching = (matching * decay + num_proposing, offered * decay + num_offered)

    def _observe_unmatched(self, bucket: int, seconds: float) -> None:
        total, weight = self._unmatched.get(bucket, (0.0, 0.0))
        if weight and seconds > self.OUTLIER * total / weight:
            return  # an idle gap
        self._unmatched[bucket] = (total * self.TIME_DECAY + seconds,
                                   weight * self.TIME_DECAY + 1)

    def _observe_coverage(self, num_seqs: int, num_proposed: list[int], k: int) -> None:
        """Host drafts: of the num_seqs sequences of a step verifying in a shape of k drafts,
        how many proposed each position (num_proposed: per sequence); forgetting step by step."""
        proposed = np.asarray(num_proposed, np.int64)
        covered = (proposed[:, None] > np.arange(k)).sum(axis=0).tolist()  # [k]
        decay = self.COVERAGE_DECAY
        for j in range(k):
            self._verifying[j] = self._verifying[j] * decay + num_seqs
            self._proposing[j] = self._proposing[j] * decay + covered[j]

    def _observe_seconds(self, bucket: int, k: int, seconds: float) -> None:
        if k not in (0, *self.shapes.spec_ks):
            return
        total, weight = self._measured.get((bucket, k), (0.0, 0.0))
        if seconds > self.OUTLIER * self.seconds(bucket, k) * (1 if weight else self.OUTLIER):
            return
        age = self._num_observed - self._last_measured.get((bucket, k), self._num_observed)
        decay = self.TIME_DECAY * self.AGE_DECAY ** age
        drift = self._drift(bucket, k)  # the cell's earlier steps, at today's t(0)
        self._measured[bucket, k] = (total * drift * decay + seconds, weight * decay + 1)
        t0 = self._mean(bucket, 0)
        if k and t0:
            self._t0_then[bucket, k] = t0
        self._last_measured[bucket, k] = self._last_run[bucket, k] = self._num_observed
        self._num_samples[bucket, k] = self._num_samples.get((bucket, k), 0) + 1
        error_sum, error_weight = self._log_error.get(k, (0.0, 0.0))
        self._log_error[k] = (error_sum * self.TIME_DECAY
                              + math.log(seconds / self.costs[bucket][k]),
                              error_weight * self.TIME_DECAY + 1)

    def as_dict(self) -> dict:
        return {**self.metrics.as_dict(), "spec_decode_num_speculative_tokens": self.k,
                "spec_decode_steps_per_k": list(self.steps_per_k)}
