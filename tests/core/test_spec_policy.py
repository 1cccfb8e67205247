"""How many drafts to propose: the adaptive policy on synthetic measurements, and its config."""

from __future__ import annotations

import copy

import pytest

from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.core.spec_policy import AdaptiveSpeculation
from pagedjax.core.step_shapes import StepShapes


def config(tmp_path, k: int = 4, adaptive: bool = True) -> SpeculativeConfig:
    (tmp_path / "config.json").write_text("{}")
    return SpeculativeConfig.from_dict({"model": str(tmp_path), "num_speculative_tokens": k,
                                        "adaptive": adaptive})


def shapes(k: int = 4, draft_model: bool = True) -> StepShapes:
    return StepShapes.for_engine(max_num_seqs=64, max_num_batched_tokens=256,
                                 max_blocks_per_seq=8, max_model_len=128,
                                 num_speculative_tokens=k, draft_model=draft_model)


def costs(seconds: callable, k: int = 4) -> dict[int, dict[int, float]]:
    """A startup cost table: seconds(k, batch bucket) at every bucket and compiled k."""
    table = shapes(k)
    return {s: {j: seconds(j, s) for j in (0, *table.spec_ks)} for s in table.seq_buckets}


def policy_for(tmp_path, seconds: callable, k: int = 4, adaptive: bool = True,
               draft_model: bool = True) -> AdaptiveSpeculation:
    """draft_model=False: the host proposes the drafts (never behind, so probes never wait)."""
    return AdaptiveSpeculation(config(tmp_path, k, adaptive), shapes(k, draft_model),
                               costs(seconds, k) if adaptive else None)


def decode_step(num_seqs: int, k: int) -> SchedulerOutput:
    return SchedulerOutput(seq_ids=list(range(num_seqs)), num_computed_tokens=[10] * num_seqs,
                           num_new_tokens=[1] * num_seqs, num_spec_tokens_per_seq=[k] * num_seqs,
                           num_batched_tokens=num_seqs * (1 + k), num_spec_tokens=k)


def simulate(policy: AdaptiveSpeculation, num_seqs: int, steps: int, accepted: int,
             seconds: callable | None = None) -> list[int]:
    """Run the policy against a fake engine whose drafts are accepted `accepted` at a time and
    whose steps take seconds(k, num_seqs) (None: the step measures nothing); returns the
    chosen k per step."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(num_seqs)
        sampled = SampledTokens.from_lists(
            {i: [0] * (min(accepted, k) + 1) for i in range(num_seqs)})
        policy.observe(decode_step(num_seqs, k), sampled,
                       None if seconds is None else seconds(k, num_seqs))
        chosen.append(k)
    return chosen


def test_drafts_that_are_never_accepted_are_switched_off(tmp_path) -> None:
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.2 * k, draft_model=False)
    chosen = simulate(policy, 32, 200, accepted=0)
    assert chosen[0] == 4  # unmeasured positions promise everything: the first step drafts
    assert policy.expected_tokens(4) == pytest.approx(1.0)
    # then k = 0, bar one drafting step every PROBE_EVERY that keeps acceptance measured
    assert chosen[-64:].count(0) == 64 - 64 // policy.PROBE_EVERY


def mixed_step(num_seqs: int) -> SchedulerOutput:
    """A step that computes a prompt chunk of 16 tokens per sequence, the draft catching up."""
    return SchedulerOutput(seq_ids=list(range(num_seqs)), num_computed_tokens=[0] * num_seqs,
                           num_new_tokens=[16] * num_seqs, num_draft_tokens=[16] * num_seqs,
                           num_batched_tokens=16 * num_seqs)


def test_a_draft_models_probe_waits_for_a_sequence_whose_draft_is_current(tmp_path) -> None:
    """k = 0 steps leave a draft model behind: a due probe waits for a step that leaves some
    draft current (a prompt computed, its draft catching up) and runs in the next, or runs
    anyway after FORCE_PROBE_AFTER steps."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.2 * k)
    chosen = simulate(policy, 32, 60, accepted=0)
    assert chosen[0] == 4 and chosen[1:] == [0] * 59  # due at 32, but every draft is behind
    policy.choose(32)
    policy.observe(mixed_step(32), SampledTokens.from_lists({i: [0] for i in range(32)}))
    assert policy.choose(32) > 0  # the probe, while the new prompts' drafts are current
    policy.observe(decode_step(32, policy.k), SampledTokens.from_lists(
        {i: [0] for i in range(32)}))
    chosen = simulate(policy, 32, policy.FORCE_PROBE_AFTER, accepted=0)
    assert chosen[:-1] == [0] * (policy.FORCE_PROBE_AFTER - 1) and chosen[-1] > 0


def test_drafts_pay_follows_the_choice_outside_probes(tmp_path) -> None:
    """The scheduler prefills the draft on every prompt only while drafts_pay: True before any
    step and with a fixed k, False once the policy settles on k = 0 (its probes, which draft,
    leave it False), True again when drafting wins."""
    assert policy_for(tmp_path, None, adaptive=False).drafts_pay
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.2 * k, draft_model=False)
    assert policy.drafts_pay
    chosen = simulate(policy, 32, 100, accepted=0)
    assert chosen[-1] == 0 and not policy.drafts_pay
    assert any(k > 0 for k in chosen[-64:])  # the probes drafted meanwhile
    chosen = simulate(policy, 32, 200, accepted=4)  # every draft accepted from now on
    assert chosen[-1] > 0 and policy.drafts_pay


def test_cheap_drafts_that_are_always_accepted_use_every_slot(tmp_path) -> None:
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.1 * k)
    chosen = simulate(policy, 1, 50, accepted=4)
    assert set(chosen) == {4}
    assert policy.expected_tokens(4) == pytest.approx(5.0)
    metrics = policy.as_dict()
    assert metrics["spec_decode_acceptance_per_position"] == [1.0] * 4
    assert metrics["spec_decode_num_speculative_tokens"] == 4
    assert metrics["spec_decode_steps_per_k"] == [0, 0, 0, 0, 50]


def test_the_best_k_is_in_between(tmp_path) -> None:
    """Two drafts accepted: more slots cost time and win nothing; fewer win less."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.3 * k)
    chosen = simulate(policy, 4, 100, accepted=2)
    assert chosen[-60:].count(2) >= 58  # bar the probes, one every PROBE_EVERY steps
    assert policy.expected_tokens(2) == pytest.approx(3.0)
    assert policy.expected_tokens(4) == pytest.approx(3.0)


def test_a_rarely_drafted_position_keeps_its_earlier_measurements(tmp_path) -> None:
    """Position 4 is drafted only now and then (k = 4 while the best is 3): one rejection
    there weighs as one sample among its last ~10, not as the whole estimate."""
    policy = policy_for(tmp_path, lambda k, s: 1.0)
    for _ in range(10):  # k = 4: all four drafts kept
        policy.observe(decode_step(1, 4), SampledTokens.from_lists({0: [0] * 5}))
    for _ in range(50):  # k = 3 only: positions 1-3 measured, position 4 not drafted
        policy.observe(decode_step(1, 3), SampledTokens.from_lists({0: [0] * 4}))
    # the 4th draft rejected
    policy.observe(decode_step(1, 4), SampledTokens.from_lists({0: [0] * 4}))
    gain_of_4th = policy.expected_tokens(4) - policy.expected_tokens(3)
    assert 0.8 < gain_of_4th < 0.95  # ~0.87; forgetting per step made it 1 / (1 + 10 * 0.9^50)


def test_each_batch_bucket_uses_its_own_costs(tmp_path) -> None:
    """The same drafts pay at batch 1 (drafting is nearly free) but not at batch 64."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + (0.05 if s == 1 else 1.2) * k)
    small = simulate(policy, 1, 40, accepted=1)
    large = simulate(policy, 64, 40, accepted=1)
    assert small[-30:].count(2) == 30 and large[-30:].count(0) >= 29


def test_only_compiled_ks_are_chosen(tmp_path) -> None:
    """With num_speculative_tokens = 10 the compiled ks are 2, 4, 8 and 10: with seven drafts
    accepted at a time and drafts costing little, 8 wins (7 is not compiled)."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.01 * k, k=10)
    chosen = simulate(policy, 2, 60, accepted=7)
    assert set(chosen[-40:]) == {8}
    assert set(chosen) <= {0, 2, 4, 8, 10}


def test_fixed_k_when_not_adaptive(tmp_path) -> None:
    policy = policy_for(tmp_path, None, k=3, adaptive=False)
    assert set(simulate(policy, 8, 50, accepted=0)) == {3}
    assert policy.as_dict()["spec_decode_num_draft_tokens"] == 50 * 8 * 3


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


@pytest.mark.parametrize(("gain", "drafts"), [(1.01, False), (1.05, True), (1.4, True)])
def test_drafting_must_promise_a_margin_over_k0(tmp_path, gain: float, drafts: bool) -> None:
    """Every draft accepted, t(k) tuned so that E(4) / t(4) = gain * E(0) / t(0): a promise of
    1 % (within a step time's spread) keeps k = 0, one of 5 % or more drafts."""
    slope = (5.0 / gain - 1.0) / 4  # t(k) = 1 + slope * k: t(4) = 5 / gain
    policy = policy_for(tmp_path, lambda k, s: 1.0 + slope * k)
    chosen = simulate(policy, 32, 100, accepted=4)
    assert (chosen[-60:].count(4) >= 58) == drafts  # bar the probes
    assert (chosen[-60:].count(0) >= 58) == (not drafts)


def test_a_wrong_table_is_corrected_by_the_steps_the_engine_runs(tmp_path) -> None:
    """The startup table says drafts cost 0.5 of a step each, the engine's steps show 0.05
    (the torch runs issue 47 measured): with 3 of 4 drafts accepted at batch 1, the policy
    starts at k = 0 but its probes measure the truth and it settles on k = 4, as a fixed k = 4
    would, bar its probes of the k measured longest ago; the error it learned of k = 4 moves that
    k's other buckets too."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.5 * k)
    truth = lambda k, s: 1.0 + 0.05 * k  # noqa: E731
    chosen = simulate(policy, 1, 200, accepted=3, seconds=truth)
    assert chosen[-96:].count(4) == 96 - 96 // policy.PROBE_EVERY
    assert policy.seconds(1, 4) == pytest.approx(truth(4, 1), rel=0.05)
    for k in (0, 2, 4):  # each probed at batch 1; never run at batch 64
        assert policy.seconds(64, k) == pytest.approx(truth(k, 1), rel=0.05)


def test_drafting_is_turned_off_where_the_steps_show_it_cannot_pay(tmp_path) -> None:
    """The table promises nearly free drafts, the engine's steps cost 0.6 of a step per draft
    (a large batch): with one draft in two accepted, the policy leaves k = 0 but for its
    probes."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.02 * k, draft_model=False)
    truth = lambda k, s: 1.0 + 0.6 * k  # noqa: E731
    chosen = simulate(policy, 32, 300, accepted=1, seconds=truth)
    assert chosen[-128:].count(0) == 128 - 128 // policy.PROBE_EVERY


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_it_converges_to_the_best_fixed_k(tmp_path, accepted: int) -> None:
    """Against scripted steps (time linear in k) and scripted acceptance, from a table that
    is off by a factor of 2 in the step's overhead: the policy's tokens per second over the
    last 100 steps are at least 0.97 x the best fixed k's."""
    truth = lambda k, s: 1.0 + 0.25 * k  # noqa: E731
    policy = policy_for(tmp_path, lambda k, s: 2.0 + 0.25 * k)
    chosen = simulate(policy, 8, 300, accepted=accepted, seconds=truth)

    def rate(ks: list[int]) -> float:
        return sum(1 + min(accepted, k) for k in ks) / sum(truth(k, 8) for k in ks)

    best = max(rate([k]) for k in (0, *shapes().spec_ks))
    assert rate(chosen[-100:]) >= 0.97 * best


def test_a_step_whose_draft_only_caught_up_is_no_sample(tmp_path) -> None:
    """A decode step where no sequence could draft (the draft behind after k = 0 steps) but
    the draft caught up ran a k = 4 shape for less than a k = 4 step costs: its period is a
    sample of neither t(4) nor t(0)."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.25 * k)
    caught_up = decode_step(8, 0)  # proposed nothing
    for _ in range(20):
        policy.observe(caught_up, SampledTokens.from_lists({i: [0] for i in range(8)}),
                       seconds=1.5, shape_k=4)
    assert policy.seconds(8, 4) == pytest.approx(2.0)  # the table's, untouched
    assert policy.seconds(8, 0) == pytest.approx(1.0)
    assert policy.steps_per_k == [20, 0, 0, 0, 0]


def test_partly_drafted_steps_do_not_make_drafting_look_cheap(tmp_path) -> None:
    """With a draft model, a k = 4 step where half the sequences drafted (the rest caught up)
    costs 1.5 against a full step's 3.0, while E(4) counts the drafted positions only (all
    accepted: 5 tokens). Timed as t(4), k = 4 would promise 5 / 1.5 = 3.3x k = 0 (1.0); only
    the full steps are its samples: 5 / 3.0 = 1.7x."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.5 * k)  # table t(4) = 3.0
    half = decode_step(8, 4)
    half.num_spec_tokens_per_seq = [4] * 4 + [0] * 4
    sampled = SampledTokens.from_lists({i: [0] * (5 if i < 4 else 1) for i in range(8)})
    full = SampledTokens.from_lists({i: [0] * 5 for i in range(8)})
    for step in range(20):
        policy.observe(half, sampled, seconds=1.5, shape_k=4)
        if step % 4 == 0:
            policy.observe(decode_step(8, 4), full, seconds=3.0, shape_k=4)
    assert policy.seconds(8, 4) == pytest.approx(3.0)
    assert policy.expected_tokens(4) == pytest.approx(5.0)
    # without a draft model every step verifies in its shape: the cheap ones are samples too
    host = policy_for(tmp_path, lambda k, s: 1.0 + 0.5 * k, draft_model=False)
    host.observe(half, sampled, seconds=1.5, shape_k=4)
    assert host.seconds(8, 4) == pytest.approx(1.5)


def test_a_new_bucket_is_measured_before_one_buckets_error_decides_it(tmp_path) -> None:
    """The engine adds host work the runner-only table leaves out (2 units a step): at batch 1
    every k measures 1.6-3x its table, at batch 32 1.0-1.1x. After batch-1 steps, batch 32
    tries each k once (k = 0 first) and then keeps k = 0 (its truth 34 against k = 2's 72 for
    2 tokens) but for probes. Scaled by batch 1's errors (and the table's value weighing as a
    sample beside the few measured ones), k = 0 looked 3x slower than it is and lost to k = 2
    in most steps."""
    table = lambda k, s: s * (1 + 0.6 * k)  # noqa: E731
    truth = lambda k, s: table(k, s) + 2.0  # noqa: E731
    policy = policy_for(tmp_path, table, draft_model=False)
    simulate(policy, 1, 100, accepted=1, seconds=truth)
    chosen = simulate(policy, 32, 100, accepted=1, seconds=truth)
    # off k = 0 only for the probes and the tries of k = 2 and k = 4
    assert chosen[0] == 0 and chosen.count(0) >= 100 - 100 // policy.PROBE_EVERY - 2
    assert policy.seconds(32, 0) == pytest.approx(truth(0, 32), rel=0.1)


def test_the_next_k_is_zero_while_drafting_is_off_and_nothing_is_due(tmp_path) -> None:
    """Async scheduling may launch the step after the one in flight without choose() only
    where choose() would give 0: drafting off outside probes, no probe due and no untried k at
    the bucket within two steps. A fixed k, and a policy that drafts, never qualify."""
    fixed = policy_for(tmp_path, lambda k, s: 1.0 + 0.5 * k, adaptive=False)
    assert not fixed.next_k_is_zero(8)
    truth = lambda k, s: 1.0 + 0.5 * k  # noqa: E731
    policy = policy_for(tmp_path, truth, draft_model=False)
    assert not policy.next_k_is_zero(8)  # it drafts k = 4 until it learns otherwise
    simulate(policy, 8, 100, accepted=0, seconds=truth)
    assert policy.drafts_pay is False
    promised, k = [], policy.choose(8)
    for _ in range(2 * policy.PROBE_EVERY):  # as the engine runs: step k in flight
        promise = policy.next_k_is_zero(8)  # for the step after it
        policy.observe(decode_step(8, k), SampledTokens.from_lists({i: [0] for i in range(8)}),
                       truth(k, 8))
        if promise:  # launched ahead, without choose(), which would have said 0
            assert copy.deepcopy(policy).choose(8) == 0
            k = 0
        else:
            k = policy.choose(8)
        promised.append(promise)
    # not promised: the probes (every PROBE_EVERY) and the step before each
    assert promised.count(False) <= 2 * 2
    assert not policy.next_k_is_zero(16)  # a bucket not run yet: its ks are tried first
    # a draft model's due probe waits for a current draft: the k = 0 steps run ahead meanwhile
    policy = policy_for(tmp_path, truth)
    simulate(policy, 8, 200, accepted=0, seconds=truth)
    for _ in range(policy.PROBE_EVERY):
        assert policy.next_k_is_zero(8)
        assert simulate(policy, 8, 1, accepted=0, seconds=truth) == [0]


def test_a_time_measured_on_other_prompts_is_probed_again(tmp_path) -> None:
    """k = 4 ran most steps on short prompts, then on long ones it grew slow and k = 2 took
    over; back on short prompts, the probes re-measure k = 4 (the k measured longest ago, not
    the least measured: that is k = 0) and the policy drafts 4 again."""
    short = lambda k, s: 1.0 + 0.1 * k  # noqa: E731
    long = lambda k, s: 1.0 + (0.1 if k < 4 else 0.8) * k  # noqa: E731
    policy = policy_for(tmp_path, short, draft_model=False)
    assert simulate(policy, 1, 100, accepted=4, seconds=short)[-50:].count(4) >= 48
    assert simulate(policy, 1, 100, accepted=4, seconds=long)[-50:].count(2) >= 48
    chosen = simulate(policy, 1, 300, accepted=4, seconds=short)
    assert chosen[-64:].count(4) >= 64 - 64 // policy.PROBE_EVERY


def test_a_time_measured_on_longer_prompts_follows_k0_while_only_sentinels_draft(
        tmp_path) -> None:
    """Long prompts: every step costs twice a short prompt's, no draft is accepted, and the
    policy settles on k = 0. Then short prompts whose drafts are all accepted: drafting
    now pays 1.8x, but while the policy drafts nothing a draft model's probes are drafted by
    the sentinels alone (one sequence in eight), no sample of t(k > 0). k = 0's own steps show
    every step got 2x cheaper: t(4), measured on the long prompts, moves with it (frozen at its
    old 5.6, 5 tokens / 5.6 lost to k = 0's 1 / 1.0), the sentinels' drafts weigh as drafts,
    not as steps, against the full steps' (32 drafts a position each), and the policy drafts
    again within a few probes."""
    long = lambda k, s: 2.0 + 0.9 * k  # noqa: E731
    short = lambda k, s: 1.0 + 0.45 * k  # noqa: E731
    policy = policy_for(tmp_path, long)
    chosen = simulate(policy, 32, 200, accepted=0, seconds=long)
    assert chosen[-32:].count(0) >= 31 and not policy.drafts_pay
    sentinels = [i % 8 == 0 for i in range(32)]
    for step in range(400):
        if step % 64 == 0:  # a new prompt: the sentinels' drafts catch up with it
            policy.choose(32)
            policy.observe(mixed_step(32), SampledTokens.from_lists(
                {i: [0] for i in range(32)}))
        k = policy.choose(32)
        out = decode_step(32, k)
        out.num_spec_tokens_per_seq = [k if s else 0 for s in sentinels]
        sampled = SampledTokens.from_lists(
            {i: [0] * (k + 1 if s else 1) for i, s in enumerate(sentinels)})
        policy.observe(out, sampled, short(k, 32), shape_k=k)
        if policy.drafts_pay:
            break
    assert policy.drafts_pay and step < 200
    # the next prompts' drafts are prefilled: every sequence drafts, k = 4 measured again
    chosen = simulate(policy, 32, 100, accepted=4, seconds=short)
    assert chosen[-64:].count(4) >= 62
    assert policy.seconds(32, 4) == pytest.approx(short(4, 32), rel=0.05)
    assert policy.seconds(32, 0) == pytest.approx(short(0, 32), rel=0.05)


def test_a_batch_of_a_new_size_prefills_drafts_as_its_own_bucket_chooses(tmp_path) -> None:
    """Drafting pays at batch 1 and cannot at batch 32 (a draft costs two steps there). A
    batch of 32 arrives in a step that tries k = 0 at its bucket (the first there): drafts_pay,
    which decides whether its prompts' drafts are prefilled, says what batch 32's estimates
    choose, not what batch 1's did."""
    table = lambda k, s: 1.0 + (0.1 if s == 1 else 2.0) * k  # noqa: E731
    policy = policy_for(tmp_path, table)
    assert simulate(policy, 1, 50, accepted=4, seconds=table)[-1] == 4 and policy.drafts_pay
    assert policy.choose(32) == 0 and policy._exploring
    assert not policy.drafts_pay


def test_while_drafting_is_off_a_probe_drafts_the_smallest_k(tmp_path) -> None:
    """No draft is accepted: the policy drafts nothing but its probes, and each probe runs the
    cheapest drafting step (k = 2: the demo pair's k = 4 probe at batch 32 on torch cost ~4 % of
    a batch, k = 2 about half that) rather than the k measured longest ago."""
    truth = lambda k, s: 1.0 + 0.6 * k  # noqa: E731
    policy = policy_for(tmp_path, truth, draft_model=False)
    chosen = simulate(policy, 32, 300, accepted=0, seconds=truth)
    probes = [k for k in chosen[-128:] if k]
    assert probes == [2] * (128 // policy.PROBE_EVERY)


@pytest.mark.parametrize("cost, probes_of_k2", [(0.05, 4), (0.3, 12)])
def test_while_drafting_pays_by_far_a_k_is_probed_where_its_rate_could_win(
        tmp_path, cost: float, probes_of_k2: int) -> None:
    """Every draft accepted at batch 1: k = 4 yields 5 tokens a step. k = 0's rate is 0.24x
    (drafts at 0.05 of a step each) or 0.44x (at 0.3) k = 4's, far past what its estimates'
    error could hide: of the last 512 steps, 4 probe k = 0, once every STALE_AFTER. k = 2's is
    0.65x, re-timed as seldom, or 0.82x, within PROBE_OPTIMISM: it takes every other probe
    (every PROBE_EVERY steps). Before, k = 0 and k = 2 took turns in every probe."""
    truth = lambda k, s: 1.0 + cost * k  # noqa: E731
    policy = policy_for(tmp_path, truth)
    last = simulate(policy, 1, 1024, accepted=4, seconds=truth)[-512:]
    assert policy.STALE_AFTER == 4 * policy.PROBE_EVERY == 128
    assert (last.count(0), last.count(2)) == (4, probes_of_k2)
    assert last.count(4) == 512 - 4 - probes_of_k2


def test_a_k_timed_by_a_slow_first_step_is_probed_until_timed_enough(tmp_path) -> None:
    """A bucket's first k = 0 step ran at 1.7x the later ones (the demo pair at batch 8: 6.9-8.5
    ms against 5-5.7), and k = 4, every draft accepted, promises far more: k = 0 is still
    probed until PROBE_MIN_SAMPLES steps timed it, so its estimate nears the later steps'
    within 128 steps (1.12: the first step's weight decays with its age), where it kept 1.7
    until the first STALE_AFTER's end."""
    timed = []

    def truth(k: int, s: int) -> float:
        if k:
            return 1.0 + 0.05 * k
        timed.append(k)
        return 1.7 if len(timed) == 1 else 1.0

    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.05 * k)
    chosen = simulate(policy, 1, 4 * policy.PROBE_EVERY, accepted=4, seconds=truth)
    assert chosen.count(0) == policy.PROBE_MIN_SAMPLES == 3
    assert policy.seconds(1, 0) < 1.15


def simulate_host_drafts(policy: AdaptiveSpeculation, num_seqs: int, steps: int,
                         proposes: callable, seconds: callable,
                         last: int = 100) -> tuple[list[int], float]:
    """Host drafts (n-gram, suffix): in step n sequence i proposes k drafts if proposes(n, i),
    else none, and proposals are always accepted; the step runs the shape of the most drafts
    proposed and takes seconds(shape k, k offered) (padding rows cost as much as real ones).
    Returns the chosen k per step and the tokens per second of the last `last` steps."""
    chosen, tokens, elapsed = [], [], []
    for n in range(steps):
        k = policy.choose(num_seqs)
        per_seq = [k if k and proposes(n, i) else 0 for i in range(num_seqs)]
        shape_k = max(per_seq)
        out = SchedulerOutput(seq_ids=list(range(num_seqs)), num_computed_tokens=[10] * num_seqs,
                              num_new_tokens=[1] * num_seqs,
                              num_spec_tokens_per_seq=per_seq if shape_k else [],
                              num_batched_tokens=num_seqs + sum(per_seq),
                              num_spec_tokens=shape_k)
        sampled = SampledTokens.from_lists({i: [0] * (per_seq[i] + 1) for i in range(num_seqs)})
        policy.observe(out, sampled, seconds(shape_k, k), shape_k=shape_k)
        chosen.append(k)
        tokens.append(sum(per_seq) + num_seqs)
        elapsed.append(seconds(shape_k, k))
    return chosen, sum(tokens[-last:]) / sum(elapsed[-last:])


def test_host_drafts_that_few_sequences_propose_are_switched_off(tmp_path) -> None:
    """Batch 16, a quarter of the sequences find a match each step, whose drafts are always
    accepted, and a verifying step costs 1 + 0.5 k whoever proposed (compute-bound rows).
    Counting only the sequences that proposed, E(4) = 5 against t(4) = 3 would promise 1.7x;
    a verifying step's sequence yields 1 + 4 / 4 = 2 tokens: 0.67x, so drafting is off."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.5 * k, draft_model=False)
    chosen, _ = simulate_host_drafts(policy, 16, 300, lambda n, i: (n + i) % 4 == 0,
                                     lambda k, offered: 1.0 + 0.5 * k)
    assert policy.expected_tokens(4) == pytest.approx(2.0, rel=0.05)
    assert chosen[-128:].count(0) == 128 - 128 // policy.PROBE_EVERY


def test_host_drafts_that_match_in_some_steps_are_kept_at_batch_one(tmp_path) -> None:
    """Batch 1, a match in 3 steps of 10, always accepted; a step without one runs k = 0's
    shape (1.0), a verifying step costs 1 + 0.4 k (a small model's compute-bound rows): 5
    tokens in 2.6 where it verifies 4 drafts. Steps without a match cost nothing extra, so
    E(4) counts the verifying steps only (5, not 1 + 0.3 * 4), the policy drafts, and over the
    last 100 steps its tokens per second are at least 0.97x the best fixed k's."""
    proposes = lambda n, i: n % 10 in (2, 5, 8)  # noqa: E731
    seconds = lambda k, offered: 1.0 + 0.4 * k  # noqa: E731
    policy = policy_for(tmp_path, lambda k, s: seconds(k, 0), draft_model=False)
    chosen, rate = simulate_host_drafts(policy, 1, 300, proposes, seconds)
    assert policy.expected_tokens(4) == pytest.approx(5.0)
    assert chosen[-100:].count(4) >= 90
    best = max(simulate_host_drafts(policy_for(tmp_path, lambda k, s: 1.0, adaptive=False, k=k,
                                               draft_model=False), 1, 300, proposes, seconds)[1]
               for k in (2, 4))
    assert rate >= 0.97 * best


@pytest.mark.parametrize(("matches", "drafts"), [(1, False), (6, True)])
def test_offering_host_drafts_costs_the_steps_that_launch_ahead(tmp_path, matches: int,
                                                                drafts: bool) -> None:
    """Batch 1 on a runner that launches k = 0 steps ahead (1.0 a step), not a step offered
    drafts, which waits for the last token: 2.0 where nothing matched, 1.3 verifying 4 drafts
    (always accepted). With a match in `matches` steps of 10, offering 4 drafts yields
    0.1 * 5 + 0.9 = 1.4 tokens in 0.1 * 1.3 + 0.9 * 2.0 = 1.93 (0.73x: drafting off), or 3.4 in
    1.58 (2.2x: on). Timed as t(0), the unmatched steps made k = 0 look slow."""
    seconds = lambda k, offered: 1.3 if k else 2.0 if offered else 1.0  # noqa: E731
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.075 * k, draft_model=False)
    chosen, _ = simulate_host_drafts(policy, 1, 300, lambda n, i: n % 10 < matches, seconds)
    assert chosen[-100:].count(4 if drafts else 0) >= 90


def test_probes_move_on_from_a_k_whose_offers_measure_nothing(tmp_path) -> None:
    """Host drafts at batch 1, drafting k = 4 (every draft accepted); offers of k = 2 never
    find a match, so they run k = 0's shape and time no t(2). Probes still take turns: k = 0
    is probed too (by the k probed or measured longest ago), where the probes went to k = 2,
    never measured, again and again."""
    policy = policy_for(tmp_path, lambda k, s: 1.0 + 0.05 * k, draft_model=False)
    chosen, _ = simulate_host_drafts(policy, 1, 1024, lambda n, i: policy.k != 2,
                                     lambda k, offered: 1.0 + 0.05 * k)
    tail = chosen[-512:]
    assert tail.count(4) >= 512 - 512 // policy.PROBE_EVERY
    assert tail.count(0) >= 2 and tail.count(2) >= 2


def simulate_ahead(policy: AdaptiveSpeculation, num_seqs: int, steps: int, accepted: int,
                   device: dict[int, float], host: float) -> list[int]:
    """As simulate, for an engine whose speculative steps launch ahead (async speculation): a
    step launches before the last one is observed where next_k_is says its k stays, and then
    costs its device time alone; a step chosen after the last one's tokens costs the host's
    work too. Returns the k of each step."""
    chosen, k, ahead = [], policy.choose(num_seqs), False
    for _ in range(steps):
        next_ahead = policy.next_k_is(k, num_seqs)  # asked while this step is in flight
        sampled = SampledTokens.from_lists(
            {i: [0] * (min(accepted, k) + 1) for i in range(num_seqs)})
        policy.observe(decode_step(num_seqs, k), sampled, device[k] + (0.0 if ahead else host),
                       launched_ahead=ahead)
        chosen.append(k)
        ahead = next_ahead
        if not ahead:
            k = policy.choose(num_seqs)
    return chosen


@pytest.mark.parametrize("start", [2, 4])
def test_with_steps_launched_ahead_every_k_is_timed_as_it_would_run(tmp_path, start) -> None:
    """Launched ahead, k = 4 costs 1.3 and k = 2 1.0 (every draft accepted: 5 / 1.3 beats
    3 / 1.0); a step that waits for the last one's tokens costs 1.5 more. With `chains`, every k
    is timed by steps launched ahead, a probe's k runs one more step to be timed so, and the
    policy settles on k = 4 whichever k a wrong startup table starts it at. Timed as they ran,
    the k it started at keeps the only fast samples: started at k = 2, it never leaves it."""
    device, host = {0: 0.8, 2: 1.0, 4: 1.3}, 1.5

    def table(k: int, s: int) -> float:  # wrong: the k it starts at looks cheap
        return {0: 0.8, 2: 1.0 if start == 2 else 9.0, 4: 1.0 if start == 4 else 9.0}[k]

    policy = policy_for(tmp_path, table)
    policy.chains = True
    chosen = simulate_ahead(policy, 1, 600, accepted=4, device=device, host=host)
    assert chosen[0] == start
    assert chosen[-200:].count(4) >= 200 * 0.9
    assert policy.seconds(1, 4) == pytest.approx(1.3) and policy.seconds(1, 2) == pytest.approx(1.0)
    if start == 2:
        stuck = policy_for(tmp_path, table)
        assert simulate_ahead(stuck, 1, 600, accepted=4, device=device,
                              host=host)[-200:].count(2) >= 200 * 0.9


def simulate_host_drafts_ahead(policy: AdaptiveSpeculation, num_seqs: int, steps: int,
                               accepted: int, device: dict[int, float], host: float
                               ) -> list[int]:
    """Host drafts with async scheduling: every sequence proposes k drafts when offered k, of
    which `accepted` are accepted; a step after one that verified nothing, where the policy's
    next k is 0 whatever it yields, launches ahead (its device time alone); any other step
    waits for the last one's tokens (the host's work beside). Returns the k of each step."""
    chosen, k, ahead = [], policy.choose(num_seqs), False
    for _ in range(steps):
        next_ahead = not k and policy.next_k_is_zero(num_seqs)  # asked while it is in flight
        out = SchedulerOutput(seq_ids=list(range(num_seqs)), num_computed_tokens=[10] * num_seqs,
                              num_new_tokens=[1] * num_seqs,
                              num_spec_tokens_per_seq=[k] * num_seqs if k else [],
                              num_batched_tokens=num_seqs * (1 + k), num_spec_tokens=k)
        sampled = SampledTokens.from_lists(
            {i: [0] * (min(accepted, k) + 1) for i in range(num_seqs)})
        policy.observe(out, sampled, device[k] + (0.0 if ahead else host), shape_k=k,
                       launched_ahead=ahead)
        chosen.append(k)
        ahead = next_ahead
        k = 0 if ahead else policy.choose(num_seqs)
    return chosen


@pytest.mark.parametrize("zero_ahead", [True, False])
def test_host_drafts_time_k_zero_as_it_runs_ahead(tmp_path, zero_ahead: bool) -> None:
    """Batch 16, every sequence proposes and one draft is accepted (E(2) = E(4) = 2); k = 0
    steps launch ahead in 1.0, a step that waits for the last one's tokens costs 1.0 more, and
    verifying steps always wait: 2 tokens in 2.4 (k = 2) lose to 1 in 1.0. With `zero_ahead`,
    t(0) is timed by k = 0 steps launched ahead (a probe or try of k = 0 runs a chain of
    them) and drafting is off bar its probes; timed as they ran, every k = 0 step the policy
    saw followed a verifying step and waited (2.0), and drafting looked 1.7x faster."""
    device = {0: 1.0, 2: 1.4, 4: 1.8}
    policy = policy_for(tmp_path, lambda k, s: device[k], draft_model=False)
    policy.zero_ahead = zero_ahead
    chosen = simulate_host_drafts_ahead(policy, 16, 600, accepted=1, device=device, host=1.0)
    assert policy.expected_tokens(2) == pytest.approx(2.0, rel=0.05)
    if zero_ahead:
        assert policy.seconds(16, 0) == pytest.approx(1.0)
        assert chosen[-200:].count(0) >= 200 * 0.9
    else:
        assert policy.seconds(16, 0) == pytest.approx(2.0)
        assert chosen[-200:].count(0) <= 200 * 0.1
