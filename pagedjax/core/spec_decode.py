"""Speculative decoding: its configuration, its metrics, and how many drafts to propose.

Draft and target share one BlockManager and one block table per sequence; the runner keeps a KV
cache per model indexed by the same block ids and runs the whole speculative step on the device
(draft catch-up, k draft steps, one ragged target pass over k + 1 positions per sequence, exact
rejection sampling). The core only reserves draft slots and rolls back rejected ones.

`AdaptiveSpeculation` picks k (0..num_speculative_tokens) each step: the k that maximises the
expected tokens per second, from the measured acceptance per draft position and the measured step
time at the current batch size, so speculation that does not pay is switched off (k = 0).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedjax.core.batch import bucket
from pagedjax.core.scheduler_output import SchedulerOutput

_KEYS = ("model", "num_speculative_tokens", "method", "adaptive", "draft_tensor_parallel_size")
_METHODS = ("draft_model",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    model: str  # draft checkpoint directory
    num_speculative_tokens: int  # k: the most drafts proposed per sequence and step
    adaptive: bool = True  # pick k per step from measurements; False: always k

    @classmethod
    def from_dict(cls, config: dict, tensor_parallel_size: int = 1) -> SpeculativeConfig:
        unknown = set(config) - set(_KEYS)
        if unknown or "model" not in config:
            raise ValueError(f"speculative_config={config!r}: expected the keys {_KEYS} "
                             "with at least 'model' (a draft checkpoint directory).")
        method = config.get("method", "draft_model")
        if method not in _METHODS:
            raise ValueError(f"speculative_config method={method!r} is not supported; use one of "
                             f"{_METHODS}.")
        k = config.get("num_speculative_tokens", 4)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}].")
        draft_tp = config.get("draft_tensor_parallel_size", tensor_parallel_size)
        if draft_tp not in (1, tensor_parallel_size):
            raise ValueError(f"speculative_config draft_tensor_parallel_size={draft_tp!r} must be "
                             f"1 (the draft replicated on every device) or the target's "
                             f"tensor_parallel_size={tensor_parallel_size} (the draft split).")
        adaptive = config.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config adaptive={adaptive!r} must be True or False.")
        if not (Path(config["model"]) / "config.json").is_file():
            raise ValueError(f"speculative model={config['model']!r} is not a Hugging Face "
                             "checkpoint directory (no config.json).")
        return cls(str(config["model"]), k, adaptive)

    def check_vocabulary(self, target_dir: str, target_tokenizer: Any, draft_tokenizer: Any,
                         target_vocab_size: int, draft_vocab_size: int) -> None:
        """The draft must speak the target's vocabulary: same size and same token strings."""
        same_size = target_vocab_size == draft_vocab_size
        same_tokens = (target_tokenizer is None or draft_tokenizer is None
                       or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab())
        if not (same_size and same_tokens):
            raise ValueError(
                f"draft {self.model!r} (vocab_size {draft_vocab_size}) does not share the "
                f"target {target_dir!r}'s tokenizer vocabulary (vocab_size {target_vocab_size}"
                f"{'' if same_tokens else ', different tokens'}); use a draft trained with the "
                "target's tokenizer.")


def read_vocab_size(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def verified_drafts(out: SchedulerOutput, sampled: dict[int, list[int]]) -> list[tuple[int, int]]:
    """(drafts proposed, drafts accepted) of each sequence that drafted this step."""
    return [(e.num_spec_tokens, len(sampled[e.seq_id]) - 1)
            for e in out.scheduled if e.num_spec_tokens]


class SpecDecodeMetrics:
    """Draft tokens proposed and accepted, in total and per draft position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts_per_pos = [0] * num_speculative_tokens
        self.num_accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.num_drafts_per_pos[j] += 1
            self.num_accepted_per_pos[j] += j < num_accepted

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            # verifications that carried at least one draft
            "spec_decode_num_verifications": self.num_drafts_per_pos[0],
            # position j: the share of verifications with > j drafts whose first j + 1 were kept
            "spec_decode_acceptance_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.num_accepted_per_pos, self.num_drafts_per_pos)],
        }


@dataclass
class _BatchCosts:
    """Measured seconds per decode step at one batch-size bucket: the latest samples per k."""

    samples: dict[int, deque[float]] = field(default_factory=dict)
    num_choices: int = 0
    next_probe: int = 0  # choice count at which to probe a neighbour of the best k
    probe_interval: int = 0
    last_probe: int = 1  # direction of the last neighbour probe
    num_probes: int = 0
    probe_k: int = 0
    probe_steps_left: int = 0  # a probe runs PROBE_STEPS steps: enough to move a median
    probe_steps_unseen: int = 0  # steps of the latest probe not yet observed
    probe_seconds: float = 0.0  # what its observed steps took
    best: int = -1

    def count(self, k: int) -> int:
        return len(self.samples.get(k, ()))

    def add(self, k: int, seconds: float, window: int) -> None:
        self.samples.setdefault(k, deque(maxlen=window)).append(seconds)

    def seconds(self) -> dict[int, float]:
        """k -> the median of its latest samples: one slow step (a collection, a busy core)
        moves no decision."""
        return {k: statistics.median(s) for k, s in self.samples.items()}

    def explored(self, max_k: int, min_samples: int) -> bool:
        """Both ends measured min_samples times: t(k) is known or interpolated for every k."""
        return min(self.count(max_k), self.count(0)) >= min_samples


class AdaptiveSpeculation:
    """Chooses k per step: argmax over k of E(k) / t(k), where E(k) = 1 + sum_{j<k} a_j are the
    expected tokens per sequence (a_j: chance that the first j + 1 drafts are accepted, an EMA)
    and t(k) the measured decode step time at this batch size (interpolated where unmeasured);
    a k > 0 must beat k = 0 by MIN_GAIN.

    A step time is the median of the latest WINDOW samples of that k at that batch size. The
    first batch size measures k = max and k = 0, MIN_SAMPLES times each, in turns; a later one
    measures only its k = 0 and borrows the relative cost of drafting from the nearest batch size
    that has measured some (`_donor`) until its own measurements replace the guesses
    (`_borrowed`). Then it re-measures a neighbour of the current best now and then, and every
    other time k = 0 (the baseline that speculation must beat), so the estimates follow the
    workload: after PROBE_EVERY steps, and twice as long after each probe that changed nothing
    (up to MAX_PROBE_EVERY), and never so often that probes cost more than PROBE_BUDGET of the
    time. A probe runs PROBE_STEPS steps, so that its samples can move a median; what those
    steps really took (the first one also pays for the draft's catch-up over every token since
    it last ran) pushes the next probe back as far as the budget requires.
    """

    WINDOW = 5  # step-time samples kept per k and batch size
    MIN_SAMPLES = 3  # of k = max and of k = 0, before any choice
    PROBE_STEPS = 3  # steps per probe
    ACCEPTANCE_DECAY = 0.9  # per step that drafts a position: its last ~10 such steps count
    PROBE_EVERY = 32
    MAX_PROBE_EVERY = 512
    PROBE_BUDGET = 0.02  # the share of time probes may cost over the best k's steps
    # Drafting must promise this much more than k = 0 to be chosen. The estimate is optimistic
    # where speculation barely pays: a step's median moves by ~10 % on a busy host, and in a
    # batch that drains (nothing waiting) the sequences that drafted well finish first, leaving
    # the others to run in smaller, less efficient steps. Torch at batch 32 on the demo pair
    # (2-core CPU) read E(3) / t(3) 1.2x k = 0's while fixed k ran 0.86-0.89x; at a margin of
    # 1.2 the policy drafted now and then and ran 0.92-1.0x, at 1.3 0.97-1.01x.
    MIN_GAIN = 1.3

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_k = config.num_speculative_tokens
        self.adaptive = config.adaptive
        self.metrics = SpecDecodeMetrics(self.max_k)
        self.k = self.max_k  # the latest choice
        self.steps_per_k = [0] * (self.max_k + 1)  # steps run with each k
        self._drafted = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k
        self._costs: dict[int, _BatchCosts] = {}

    def choose(self, num_seqs: int) -> int:
        """k for a step that will run about num_seqs sequences."""
        if not self.adaptive:
            return self.max_k
        batch = bucket(num_seqs)
        costs = self._costs.setdefault(batch, _BatchCosts())
        costs.num_choices += 1
        donor = None
        if not costs.explored(self.max_k, self.MIN_SAMPLES):
            donor = self._donor(batch)
            if donor is None:  # the first batch size: both ends first, in turns
                self.k = self.max_k if costs.count(self.max_k) <= costs.count(0) else 0
                return self.k
            if costs.count(0) < self.MIN_SAMPLES:  # its baseline first (costs nothing extra)
                self.k = 0
                return self.k
        if costs.probe_steps_left:
            costs.probe_steps_left -= 1
            self.k = costs.probe_k
            return self.k
        seconds = costs.seconds() if donor is None else self._borrowed(costs, donor)
        best = max(range(self.max_k + 1), key=lambda k: self._score(seconds, k)
                   * (self.MIN_GAIN if k == 0 else 1.0))
        if best != costs.best:  # the estimates moved: probe again soon
            costs.best, costs.probe_interval = best, self.PROBE_EVERY
            neighbours = {max(best - 1, 0), min(best + 1, self.max_k)} - {best}
            costs.next_probe = costs.num_choices + max(
                [self.PROBE_EVERY, *(self._probe_gap(seconds, best, k) for k in neighbours)])
        elif costs.num_choices >= costs.next_probe:
            costs.probe_interval = min(2 * costs.probe_interval, self.MAX_PROBE_EVERY)
            costs.num_probes += 1
            probe = best
            if best > 1 and costs.num_probes % 2 == 0:
                probe = 0  # the baseline drifts too (contexts grow): re-measure it
            else:
                costs.last_probe = -costs.last_probe if 0 < best < self.max_k else (
                    1 if best == 0 else -1)
                probe = best + costs.last_probe
            costs.next_probe = costs.num_choices + max(
                costs.probe_interval, self._probe_gap(seconds, best, probe))
            costs.probe_k, costs.probe_steps_left = probe, self.PROBE_STEPS - 1
            costs.probe_steps_unseen, costs.probe_seconds = self.PROBE_STEPS, 0.0
            best = probe
        self.k = best
        return best

    def observe(self, out: SchedulerOutput, sampled: dict[int, list[int]], seconds: float,
                timed: bool) -> None:
        """Record a step: its drafts' fate, and (timed: a decode step that compiled nothing)
        its wall time under the k it ran with."""
        self.steps_per_k[out.num_spec_tokens] += 1
        verified = verified_drafts(out, sampled)
        # each position forgets only when it is drafted again: one rarely drafted (a probe of
        # a larger k) keeps its last ~10 steps' measurements instead of its latest one alone
        deepest = max((num_drafts for num_drafts, _ in verified), default=0)
        for j in range(deepest):
            self._drafted[j] *= self.ACCEPTANCE_DECAY
            self._accepted[j] *= self.ACCEPTANCE_DECAY
        for num_drafts, num_accepted in verified:
            self.metrics.record(num_drafts, num_accepted)
            for j in range(num_drafts):
                self._drafted[j] += 1
                self._accepted[j] += j < num_accepted
        if timed and self.adaptive:
            costs = self._costs.setdefault(bucket(len(out.scheduled)), _BatchCosts())
            costs.add(out.num_spec_tokens, seconds, self.WINDOW)
            if costs.probe_steps_unseen and out.num_spec_tokens == costs.probe_k:
                self._account_probe(costs, seconds)

    def _account_probe(self, costs: _BatchCosts, seconds: float) -> None:
        """Add a step of the latest probe; after its last, push the next probe back as far as
        what the probe really cost requires (PROBE_BUDGET of the time at the best k). Its
        first step can cost several times its median: the draft catches up on every token
        since it last ran."""
        costs.probe_steps_unseen -= 1
        costs.probe_seconds += seconds
        if not costs.probe_steps_unseen:
            base = _interpolate(costs.seconds(), costs.best)
            extra = costs.probe_seconds - self.PROBE_STEPS * base
            gap = math.ceil(max(extra, 0.0) / (self.PROBE_BUDGET * base))
            costs.next_probe = max(costs.next_probe, costs.num_choices + gap)

    def expected_tokens(self, k: int) -> float:
        """Tokens per sequence and step with k drafts: 1 + sum_{j<k} P(first j + 1 accepted)."""
        total, rate = 1.0, 1.0
        for j in range(k):
            if self._drafted[j] > 0:
                rate = self._accepted[j] / self._drafted[j]
            total += rate  # unmeasured positions: as the last measured one
        return total

    def _probe_gap(self, seconds: dict[int, float], best: int, probe: int) -> int:
        """Steps to wait after a probe of k = probe so that probes cost at most PROBE_BUDGET of
        the time spent at k = best (a probe of a costly k, such as drafting at a large batch
        that does not pay, is rare)."""
        extra = _interpolate(seconds, probe) / _interpolate(seconds, best) - 1
        return math.ceil(self.PROBE_STEPS * max(extra, 0.0) / self.PROBE_BUDGET)

    def _donor(self, batch: int) -> _BatchCosts | None:
        """The batch-size bucket nearest to batch (in log2) that has measured its baseline and
        some k > 0, if any: its own measurements are what it lends."""
        lenders = [b for b, c in self._costs.items()
                   if b != batch and c.count(0) >= self.MIN_SAMPLES
                   and any(k and c.count(k) for k in c.samples)]
        if not lenders:
            return None
        nearest = min(lenders, key=lambda b: (abs(math.log2(b / batch)), -b))
        return self._costs[nearest]

    def _borrowed(self, costs: _BatchCosts, donor: _BatchCosts) -> dict[int, float]:
        """t(k) for every k at a batch size that has measured its baseline t(0) but not both
        ends: its own medians where it has them, else t(0) * (1 + c * (r(k) - 1)), with r(k)
        the donor's t(k) / t(0) and c the draft overhead measured here over the donor's
        (the median over the k > 0 measured here; 1 before any). A new batch size so skips the
        costly measurements of k = max, and a wrong guess costs one step, which replaces it."""
        own, theirs = costs.seconds(), donor.seconds()
        ratio = {k: _interpolate(theirs, k) / theirs[0] for k in range(self.max_k + 1)}
        base = own[0]
        scales = [(own[k] / base - 1) / (ratio[k] - 1) for k in own if k and ratio[k] > 1]
        scale = statistics.median(scales) if scales else 1.0
        return {k: own[k] if k in own else base * (1 + scale * (ratio[k] - 1))
                for k in range(self.max_k + 1)}

    def _score(self, seconds: dict[int, float], k: int) -> float:
        return self.expected_tokens(k) / _interpolate(seconds, k)

    def as_dict(self) -> dict:
        return {**self.metrics.as_dict(), "spec_decode_num_speculative_tokens": self.k,
                "spec_decode_steps_per_k": list(self.steps_per_k)}


def _interpolate(seconds: dict[int, float], k: int) -> float:
    """t(k): measured, else linear between the nearest measured k on either side, else (past
    the largest measured k) on the line through t(0) and it: each draft costs the same."""
    if k in seconds:
        return seconds[k]
    below = max(x for x in seconds if x < k)
    if all(x < k for x in seconds):
        return seconds[0] + (seconds[below] - seconds[0]) * k / below if below else seconds[0]
    above = min(x for x in seconds if x > k)
    w = (k - below) / (above - below)
    return seconds[below] * (1 - w) + seconds[above] * w
