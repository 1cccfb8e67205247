"""How many drafts to propose: the adaptive policy on synthetic measurements, and its config."""

from __future__ import annotations

import pytest

from pagedjax.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedjax.core.spec_decode import AdaptiveSpeculation, SpeculativeConfig


def config(tmp_path, k: int = 4, adaptive: bool = True) -> SpeculativeConfig:
    (tmp_path / "config.json").write_text("{}")
    return SpeculativeConfig.from_dict({"model": str(tmp_path), "num_speculative_tokens": k,
                                        "adaptive": adaptive})


def decode_step(num_seqs: int, k: int) -> SchedulerOutput:
    entries = [ScheduledSequence(i, [1], 10, [0], num_spec_tokens=k) for i in range(num_seqs)]
    return SchedulerOutput(entries, [], [], num_seqs * (1 + k), num_spec_tokens=k)


def simulate(policy: AdaptiveSpeculation, num_seqs: int, steps: int, accepted: int,
             seconds: callable) -> list[int]:
    """Run the policy against a fake engine whose step costs seconds(k) and whose drafts are
    accepted `accepted` at a time; returns the chosen k per step."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(num_seqs)
        out = decode_step(num_seqs, k)
        sampled = {i: [0] * (min(accepted, k) + 1) for i in range(num_seqs)}
        policy.observe(out, sampled, seconds(k), timed=True)
        chosen.append(k)
    return chosen


def test_drafts_that_are_never_accepted_are_switched_off(tmp_path) -> None:
    policy = AdaptiveSpeculation(config(tmp_path))
    chosen = simulate(policy, 32, 200, accepted=0, seconds=lambda k: 1.0 + 0.2 * k)
    assert chosen[:6] == [4, 0] * 3  # both ends measured first, in turns
    assert chosen[-60:].count(0) >= 57  # then k = 0, bar the periodic probes of k = 1
    assert policy.expected_tokens(4) == pytest.approx(1.0)
    later = simulate(policy, 32, 1000, accepted=0, seconds=lambda k: 1.0 + 0.2 * k)
    # Probes (a few steps each) back off while they change nothing.
    assert sum(k != 0 for k in later) <= 3 * policy.PROBE_STEPS


def test_cheap_drafts_that_are_always_accepted_use_every_slot(tmp_path) -> None:
    policy = AdaptiveSpeculation(config(tmp_path))
    chosen = simulate(policy, 1, 200, accepted=4, seconds=lambda k: 1.0 + 0.1 * k)
    assert chosen[-60:].count(4) >= 57
    assert policy.expected_tokens(4) == pytest.approx(5.0)
    metrics = policy.as_dict()
    assert metrics["spec_decode_acceptance_per_position"] == [1.0] * 4
    assert metrics["spec_decode_num_speculative_tokens"] == chosen[-1]


def test_the_best_k_is_in_between(tmp_path) -> None:
    """Two drafts accepted: more slots cost time and win nothing; fewer win less."""
    policy = AdaptiveSpeculation(config(tmp_path))
    chosen = simulate(policy, 4, 300, accepted=2, seconds=lambda k: 1.0 + 0.3 * k)
    assert chosen[-60:].count(2) >= 57
    assert policy.expected_tokens(2) == pytest.approx(3.0)
    assert policy.expected_tokens(4) == pytest.approx(3.0)


def test_a_rarely_drafted_position_keeps_its_earlier_measurements(tmp_path) -> None:
    """Position 4 is drafted only now and then (probes of k = 4 while the best is 3): one
    rejection there weighs as one sample among its last ~10, not as the whole estimate."""
    policy = AdaptiveSpeculation(config(tmp_path))
    for _ in range(10):  # k = 4: all four drafts kept
        policy.observe(decode_step(1, 4), {0: [0] * 5}, 1.0, timed=False)
    for _ in range(50):  # k = 3 only: positions 1-3 measured, position 4 not drafted
        policy.observe(decode_step(1, 3), {0: [0] * 4}, 1.0, timed=False)
    policy.observe(decode_step(1, 4), {0: [0] * 4}, 1.0, timed=False)  # the 4th draft rejected
    gain_of_4th = policy.expected_tokens(4) - policy.expected_tokens(3)
    assert 0.8 < gain_of_4th < 0.95  # ~0.87; forgetting per step made it 1 / (1 + 10 * 0.9^50)


def test_each_batch_size_learns_its_own_k(tmp_path) -> None:
    """The same drafts pay at batch 1 (drafting is nearly free) but not at batch 64."""
    policy = AdaptiveSpeculation(config(tmp_path))
    small = simulate(policy, 1, 100, accepted=1, seconds=lambda k: 1.0 + 0.05 * k)
    large = simulate(policy, 64, 100, accepted=1, seconds=lambda k: 1.0 + 1.2 * k)
    assert small[-30:].count(1) >= 28 and large[-30:].count(0) >= 28


def test_a_new_batch_size_borrows_the_cost_of_drafting(tmp_path) -> None:
    """Once batch 32 has found drafting too costly, batch 16 measures only its own baseline and
    never pays for k = max; the costs it borrows are scaled by its own baseline."""
    policy = AdaptiveSpeculation(config(tmp_path))
    simulate(policy, 32, 100, accepted=1, seconds=lambda k: 2.0 + 2.4 * k)
    chosen = simulate(policy, 16, 100, accepted=1, seconds=lambda k: 1.0 + 1.2 * k)
    assert chosen[:3] == [0, 0, 0] and 4 not in chosen
    assert chosen.count(0) >= 95


def test_a_wrong_borrowed_guess_is_corrected_by_one_measurement(tmp_path) -> None:
    """Drafts are nearly free at batch 1 but cost 1.2x a step at batch 64: batch 64 tries the
    borrowed guess once, scales its other guesses by what it measured, and stops drafting."""
    policy = AdaptiveSpeculation(config(tmp_path))
    simulate(policy, 1, 100, accepted=1, seconds=lambda k: 1.0 + 0.05 * k)
    chosen = simulate(policy, 64, 100, accepted=1, seconds=lambda k: 1.0 + 1.2 * k)
    assert chosen[:3] == [0, 0, 0]
    assert sum(k != 0 for k in chosen[3:10]) == 1  # one step of the guess, then k = 0
    assert chosen[-30:].count(0) >= 28


def test_a_batch_size_borrows_from_its_nearest_measured_neighbour(tmp_path) -> None:
    """Batch 1 (explored) finds drafts cheap, batch 16 (borrowing) finds them costly: batch 32
    borrows from batch 16, its nearest neighbour with measured drafts, and never drafts."""
    policy = AdaptiveSpeculation(config(tmp_path))
    simulate(policy, 1, 100, accepted=1, seconds=lambda k: 1.0 + 0.05 * k)
    simulate(policy, 16, 100, accepted=1, seconds=lambda k: 1.0 + 1.2 * k)
    chosen = simulate(policy, 32, 30, accepted=1, seconds=lambda k: 2.0 + 2.4 * k)
    assert chosen == [0] * 30


def test_probes_of_a_costly_k_stay_within_their_budget(tmp_path) -> None:
    """Drafting does not pay at batch 32 and a step with drafts costs 2.2x one without: the
    probes that check it again cost at most PROBE_BUDGET of the time."""
    policy = AdaptiveSpeculation(config(tmp_path))
    cost = lambda k: 1.0 + 1.2 * k  # noqa: E731
    simulate(policy, 32, 20, accepted=1, seconds=cost)  # exploration
    chosen = simulate(policy, 32, 2000, accepted=1, seconds=cost)
    extra = sum(cost(k) - cost(0) for k in chosen) / (len(chosen) * cost(0))
    assert 0 < extra <= policy.PROBE_BUDGET * 1.1  # probes run, and cheaply


def test_probes_pay_for_the_drafts_catch_up_within_their_budget(tmp_path) -> None:
    """The first drafting step after a stretch without drafts also runs the draft over every
    token since it last ran (here 8x a step): the budget holds for what probes really cost,
    not for their medians."""
    policy = AdaptiveSpeculation(config(tmp_path))
    previous = [0]

    def cost(k: int) -> float:
        catch_up = 8.0 if k and not previous[0] else 0.0
        previous[0] = k
        return 1.0 + 1.2 * k + catch_up

    simulate(policy, 32, 20, accepted=1, seconds=cost)  # exploration
    previous[0] = 0
    spent = []
    chosen = simulate(policy, 32, 3000, accepted=1,
                      seconds=lambda k: spent.append(cost(k)) or spent[-1])
    extra = sum(spent) / (len(chosen) * cost(0)) - 1
    assert 0 < extra <= policy.PROBE_BUDGET * 1.1 and chosen.count(0) > 0.95 * len(chosen)


def test_slow_outliers_move_no_decision(tmp_path) -> None:
    """One step in ten takes 20x as long (a collection, a busy core): useless drafts still
    stay off, and useful ones on."""
    for accepted, cost, want in ((0, 0.2, 0), (4, 0.1, 4)):
        policy = AdaptiveSpeculation(config(tmp_path))
        steps = iter(range(10**6))

        def seconds(k: int, cost=cost, steps=steps) -> float:
            return (1.0 + cost * k) * (20 if next(steps) % 10 == 3 else 1)

        chosen = simulate(policy, 32, 300, accepted=accepted, seconds=seconds)
        assert chosen[-100:].count(want) >= 90


def test_the_baseline_is_measured_again(tmp_path) -> None:
    """k = 0 looked slow at first (its steps were slower then): once it is cheap, the policy
    finds out through its probes and stops drafting."""
    policy = AdaptiveSpeculation(config(tmp_path))
    simulate(policy, 16, 100, accepted=1, seconds=lambda k: 1.0 + 1.5 * k if k else 3.0)
    assert policy.k == 1
    later = simulate(policy, 16, 600, accepted=1, seconds=lambda k: 1.0 + 1.5 * k)
    assert later[-100:].count(0) >= 90


def test_fixed_k_when_not_adaptive(tmp_path) -> None:
    policy = AdaptiveSpeculation(config(tmp_path, k=3, adaptive=False))
    assert set(simulate(policy, 8, 50, accepted=0, seconds=lambda k: 1.0 + k)) == {3}
    assert policy.as_dict()["spec_decode_num_draft_tokens"] == 50 * 8 * 3


def test_untimed_steps_only_count_acceptance(tmp_path) -> None:
    policy = AdaptiveSpeculation(config(tmp_path))
    k = policy.choose(2)
    policy.observe(decode_step(2, k), {0: [0, 0], 1: [0]}, 99.0, timed=False)
    assert policy.choose(2) == k  # the compile step measured nothing: k = max again
    assert policy.as_dict()["spec_decode_acceptance_per_position"] == [0.5, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad,match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens=17"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens='4'"),
    ({"adaptive": "yes"}, "adaptive='yes'"),
    ({"method": "eagle"}, "method='eagle' is not supported; use one of"),
    ({"draft": "x"}, "expected the keys"),
])
def test_bad_speculative_config(tmp_path, bad: dict, match: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"model": str(tmp_path), **bad})


def test_the_draft_must_be_a_checkpoint(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a Hugging Face checkpoint directory"):
        SpeculativeConfig.from_dict({"model": str(tmp_path / "missing")})


@pytest.mark.parametrize(("gain", "drafts"), [(1.05, False), (1.25, False), (1.4, True)])
def test_drafting_must_promise_a_margin_over_k0(tmp_path, gain: float, drafts: bool) -> None:
    """Every draft accepted, t(k) tuned so that E(4) / t(4) = gain * E(0) / t(0): a promise of
    5 % or 25 % (within the optimism of the estimate at a large batch) keeps k = 0, one of 40 %
    drafts."""
    policy = AdaptiveSpeculation(config(tmp_path))
    slope = (5.0 / gain - 1.0) / 4  # t(k) = 1 + slope * k: t(4) = 5 / gain
    chosen = simulate(policy, 32, 200, accepted=4, seconds=lambda k: 1.0 + slope * k)
    assert (chosen[-60:].count(4) >= 57) == drafts
    assert (chosen[-60:].count(0) >= 54) == (not drafts)
