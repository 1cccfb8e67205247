"""Scheduler decisions without a model: token budget, chunked prefill, FCFS, preemption."""

from __future__ import annotations

import itertools

from pagedjax.core.batch import choose_layout
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.request_policy import ParallelSampling, PolicyContext
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput
from pagedjax.core.sequence import Sequence, SequenceStatus
from pagedjax.core.step_shapes import StepShapes
from pagedjax.core.stopping import StopChecker
from pagedjax.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int, *, max_num_seqs: int = 8, budget: int = 16,
                   prefix_caching: bool = False, has_draft: bool = False) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, prefix_caching), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, stop_checker=StopChecker((), 10_000),
                     has_draft=has_draft)


def make_context(sched: Scheduler) -> PolicyContext:
    ids = itertools.count(100)
    return PolicyContext(sched, new_seq_id=lambda: next(ids), fork_seed=lambda s, i: i,
                         eos_token_ids=(), tokenizer=None)


def add(sched: Scheduler, seq_id: int, prompt_len: int, max_tokens: int = 100,
        first_token: int = 1) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, arrival=(seq_id, 0),
                   token_ids=prompt, num_prompt_tokens=prompt_len,
                   sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   rng_seed=0)
    sched.add_sequence(seq)
    return seq


def sampling(sched: Scheduler, out: SchedulerOutput) -> list[int]:
    """The step's sequences that sample (caught up with their tokens), forks after theirs."""
    rows = []
    for seq_id, end in zip(out.seq_ids, out.end_positions()):
        if end == sched.seqs[seq_id].num_tokens:
            rows += [seq_id, *out.forks.get(seq_id, ())]
    return rows


def update(sched: Scheduler, out: SchedulerOutput, rows: dict[int, list[int]]) -> list[Sequence]:
    return sched.update(out, SampledTokens.from_lists(rows))


def draft_tokens(sched: Scheduler, out: SchedulerOutput, i: int) -> list[int]:
    """The tokens the draft catches up on for the step's i-th sequence."""
    start = out.draft_start_pos[i]
    return sched.seqs[out.seq_ids[i]].token_ids[start : start + out.num_draft_tokens[i]]


def step(sched: Scheduler, token: int = 7) -> list[tuple[int, int, int]]:
    """One step with a fake model that always samples `token`; returns (seq, start, n) triples."""
    out = sched.schedule()
    update(sched, out, {seq_id: [token] for seq_id in sampling(sched, out)})
    return list(zip(out.seq_ids, out.num_computed_tokens, out.num_new_tokens))


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    sched = make_scheduler(64, budget=8)
    add(sched, 0, 3)
    add(sched, 1, 20)
    assert step(sched) == [(0, 0, 3), (1, 0, 5)]  # seq 1's prompt is chunked
    assert step(sched) == [(0, 3, 1), (1, 5, 7)]  # a decode and a chunk in one step
    assert step(sched) == [(0, 4, 1), (1, 12, 7)]
    assert step(sched) == [(0, 5, 1), (1, 19, 1)]  # seq 1 caught up: its first token sampled
    assert sched.seqs[1].num_output_tokens == 1 and sched.seqs[0].num_output_tokens == 4


def test_the_draft_runs_only_for_drafts_it_can_still_propose() -> None:
    """A step where some sequence computes several tokens (a prompt chunk) proposes no drafts:
    the draft only catches up. A decode step's k is the most drafts one of its sequences
    proposes (max_tokens caps them); a sequence on its last token neither drafts nor catches
    up, and a step with nothing for the draft does not run it."""
    sched = make_scheduler(64, budget=8, has_draft=True)
    add(sched, 0, 12, max_tokens=3)
    out = sched.schedule(4)  # a prompt chunk: no drafts, the draft catches up on it
    assert out.num_spec_tokens == 0 and out.num_spec_tokens_per_seq[0] == 0
    assert draft_tokens(sched, out, 0) == list(range(1, 9))
    update(sched, out, {})
    out = sched.schedule(4)  # the prompt's end, 4 tokens: still no drafts
    assert out.num_spec_tokens == 0 and draft_tokens(sched, out, 0) == list(range(9, 13))
    assert out.num_batched_tokens == 4
    update(sched, out, {0: [7]})
    out = sched.schedule(4)  # decoding: one draft beside its token (max_tokens leaves one)
    assert out.num_spec_tokens == out.num_spec_tokens_per_seq[0] == 1
    assert draft_tokens(sched, out, 0) == [7]
    update(sched, out, {0: [7]})  # the draft rejected
    out = sched.schedule(4)  # its last token: nothing for the draft to do
    assert out.num_spec_tokens == 0 and draft_tokens(sched, out, 0) == []
    update(sched, out, {0: [7]})
    assert sched.seqs[0].is_finished


def test_a_decode_step_catches_the_draft_up_on_k_plus_one_tokens() -> None:
    """The draft catches up in every mixed step (the prompts here) but runs in decode steps
    only with k > 0: after decode steps without drafting it lags, and a decode step catches it
    up on at most k + 1 tokens (a speculative step's shape holds no more) where few sequences
    lag; the sequence drafts once caught up."""
    sched = make_scheduler(64, budget=64, has_draft=True)
    for seq_id in range(3):
        add(sched, seq_id, 4)
    for _ in range(6):  # the prompts, then five tokens with k = 0
        out = sched.schedule(0)
        assert out.num_spec_tokens == 0
        update(sched, out, {i: [5] for i in range(3)})
    sched.seqs[1].num_draft_computed_tokens = sched.seqs[2].num_draft_computed_tokens = 9
    assert sched.seqs[0].num_draft_computed_tokens == 4  # the prompt, caught up on
    out = sched.schedule(2)  # 0: 6 tokens behind, k = 2: 3 of them now, no drafts
    assert draft_tokens(sched, out, 0) == [5, 5, 5]
    assert out.num_spec_tokens_per_seq == [0, 2, 2]
    update(sched, out, {0: [5], 1: [5], 2: [5]})
    out = sched.schedule(4)  # 4 behind: caught up, and 4 drafts
    assert out.num_spec_tokens == 4 and len(draft_tokens(sched, out, 0)) == 4


def test_a_decode_step_where_most_drafts_lag_catches_them_all_up() -> None:
    """Drafting pays again (prefill_drafts) and most sequences' drafts are more than k + 1
    tokens behind: the step offered k drafts nothing and catches every draft up at once, in a
    mixed step (more rows than any speculative shape holds); the next one drafts for all."""
    sched = make_scheduler(64, budget=64, has_draft=True)
    for seq_id in range(3):
        add(sched, seq_id, 4)
    for _ in range(6):
        update(sched, sched.schedule(0), {i: [5] for i in range(3)})
    out = sched.schedule(2)  # every draft 6 behind
    assert out.num_spec_tokens == 0 and out.num_batched_tokens == 3
    assert [draft_tokens(sched, out, i) for i in range(3)] == [[5] * 6] * 3
    shapes = StepShapes.for_engine(max_num_seqs=8, max_num_batched_tokens=64,
                                   max_blocks_per_seq=8, max_model_len=128,
                                   num_speculative_tokens=2)
    layout = choose_layout(shapes, num_seqs=3, num_samples=3, num_tokens=3,
                           num_draft_tokens=18, decode=True, max_drafts=0)
    assert not layout.num_spec_tokens and not layout.decode and layout.num_tokens >= 18
    update(sched, out, {i: [5] for i in range(3)})
    out = sched.schedule(2)
    assert out.num_spec_tokens_per_seq == [2, 2, 2]


def test_while_drafting_does_not_pay_only_sentinels_prefill_the_draft() -> None:
    """prefill_drafts=False (the policy's choice is k = 0): a new prompt's draft prefill is
    skipped but for sentinels (every SENTINEL_EVERY-th sequence); drafts past their prompt keep
    catching up. Once drafting pays, a skipped prompt's draft catches up k + 1 tokens a decode
    step, and the sequence drafts once current."""
    sched = make_scheduler(64, budget=64, has_draft=True)
    sentinel = Scheduler.SENTINEL_EVERY
    add(sched, sentinel, 4)  # a sentinel
    add(sched, sentinel + 1, 4)
    out = sched.schedule(0, prefill_drafts=False)
    assert out.seq_ids == [sentinel, sentinel + 1]
    assert draft_tokens(sched, out, 0) == [1, 2, 3, 4] and draft_tokens(sched, out, 1) == []
    update(sched, out, {sentinel: [5], sentinel + 1: [5]})
    out = sched.schedule(0, prefill_drafts=True)  # a decode step with k = 0: no catch-up
    assert out.num_draft_tokens == [0, 0]
    update(sched, out, {sentinel: [5], sentinel + 1: [5]})
    out = sched.schedule(2, prefill_drafts=True)  # drafting pays again
    assert draft_tokens(sched, out, 0) == [5, 5]  # 2 behind: caught up, and drafts
    assert out.num_spec_tokens_per_seq == [2, 0]
    assert draft_tokens(sched, out, 1) == [1, 2, 3]  # 6 behind: k + 1 of them, no drafts
    update(sched, out, {sentinel: [5], sentinel + 1: [5]})
    assert sched.seqs[sentinel + 1].num_draft_computed_tokens == 3


def test_a_prefix_hit_spares_the_draft_what_its_catch_up_computed_before() -> None:
    """The draft's KV takes the target's block ids: a cached block whose draft KV was
    computed too spares the draft's catch-up on it; one the draft never reached (it lags after
    k = 0 steps) it computes again."""
    sched = make_scheduler(64, budget=64, prefix_caching=True, has_draft=True)
    add(sched, 0, 9)  # blocks [1-4], [5-8] full after its prompt
    out = sched.schedule(0)
    assert draft_tokens(sched, out, 0) == list(range(1, 10))
    update(sched, out, {0: [20]})
    for _ in range(4):  # k = 0: the target fills block 3 ([9, 20, 20, 20]), the draft lags
        update(sched, sched.schedule(0), {0: [20]})
    assert sched.seqs[0].num_computed_tokens == 13
    assert sched.seqs[0].num_draft_computed_tokens == 9
    twin = add(sched, 1, 14)  # the same 9 tokens, then others: three blocks hit
    twin.token_ids[9:13] = [20, 20, 20, 20]
    out = sched.schedule(0)
    i = out.seq_ids.index(1)
    assert out.num_computed_tokens[i] == 12  # the target: three blocks from the cache
    assert out.draft_start_pos[i] == 8  # the draft: the two its catch-up computed
    assert draft_tokens(sched, out, i) == [9, 20, 20, 20, 20, 14]


def test_max_num_seqs_and_fcfs() -> None:
    sched = make_scheduler(64, max_num_seqs=2, budget=100)
    for i in range(3):
        add(sched, i, 2)
    assert [s for s, _, _ in step(sched)] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]
    sched.finish(sched.seqs[0], "abort")
    assert [s for s, _, _ in step(sched)] == [1, 2]


def test_head_of_line_blocks_fcfs_when_blocks_run_out() -> None:
    sched = make_scheduler(4, budget=100)
    add(sched, 0, 8)  # 2 blocks
    add(sched, 1, 12)  # 3 blocks: does not fit next to seq 0
    add(sched, 2, 1)  # would fit, but must not overtake seq 1
    assert [s for s, _, _ in step(sched)] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_preemption_takes_the_latest_arrival_and_recomputes() -> None:
    sched = make_scheduler(4, budget=100)
    a, b = add(sched, 0, 4), add(sched, 1, 4)
    step(sched)  # a full block each
    assert step(sched) == [(0, 4, 1), (1, 4, 1)]  # each takes a second block: pool full
    for _ in range(3):
        step(sched)  # positions 5..7 fit in the second blocks
    assert sched.block_manager.num_free_blocks == 0
    scheduled = step(sched)  # both need a third block: seq 1 (latest) is preempted
    assert scheduled == [(0, 8, 1)] and sched.num_preemptions_total == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and a.status is SequenceStatus.RUNNING
    sched.finish(a, "abort")
    num_tokens = b.num_tokens
    assert step(sched) == [(1, 0, num_tokens)]  # recomputes prompt + outputs in one go
    assert b.num_output_tokens == 6


def test_preempted_sequence_refinds_its_blocks_in_the_prefix_cache() -> None:
    sched = make_scheduler(4, budget=100, prefix_caching=True)
    a, b = add(sched, 0, 4), add(sched, 1, 4, first_token=50)
    for _ in range(5):
        step(sched)
    step(sched)  # b preempted: its blocks are freed tail first, and a takes b's tail block
    sched.finish(a, "abort")
    num_tokens = b.num_tokens
    assert step(sched) == [(1, 4, num_tokens - 4)]  # b's head block is still cached
    assert sched.block_manager.prefix_cache_hits == 4


def test_fork_on_prompt_completion_shares_blocks_then_copies_on_write() -> None:
    sched = make_scheduler(16, budget=100)
    seq = add(sched, 0, 6)
    seq.num_pending_forks = 2
    policy = ParallelSampling(seq, make_context(sched))
    out = sched.schedule()
    assert sampling(sched, out) == [0]  # the scheduler forks nothing
    policy.schedule(out, [0])
    assert policy.done and sampling(sched, out) == [0, 100, 101]
    assert [sched.seqs[i].rng_seed for i in (0, 100, 101)] == [0, 1, 2]
    assert [s.seq_id for s in sched.running] == [0, 100, 101]
    table = list(sched.block_manager.get_block_table(0))
    assert all(sched.block_manager.ref_count(b) == 3 for b in table)
    update(sched, out, {0: [1], 100: [2], 101: [3]})
    out = sched.schedule()  # every child writes into the shared partial block
    assert len(out.block_copies) == 2
    assert {src for src, _ in out.block_copies} == {table[1]}
    assert [sched.seqs[i].token_ids[6:] for i in (0, 100, 101)] == [[1], [2], [3]]


def test_forks_hold_seats_before_they_exist() -> None:
    """A request that will fork takes a seat per sequence it becomes (max_num_seqs = 4)."""
    sched = make_scheduler(64, max_num_seqs=4, budget=100)
    first = add(sched, 0, 2)
    first.num_pending_forks = 2  # n = 3
    second = add(sched, 1, 2)
    second.num_pending_forks = 1  # n = 2: 3 + 2 seats > 4, so it waits
    assert [s for s, _, _ in step(sched)] == [0]
    assert list(sched.waiting) == [second]


def test_a_sequence_with_nothing_to_compute_is_not_scheduled() -> None:
    """A beam whose next token its policy has not picked yet sits out; the others run."""
    sched = make_scheduler(64, budget=100)
    a, b = add(sched, 0, 3), add(sched, 1, 3)
    a.policy_picks_tokens = True
    out = sched.schedule()
    touched = update(sched, out, {0: [9], 1: [9]})
    assert touched == [b] and a.num_tokens == a.num_computed_tokens == 3  # no token for a
    assert step(sched) == [(1, 3, 1)]
    sched.append_tokens(a, [5])  # its policy picked a token
    assert step(sched) == [(0, 3, 1), (1, 4, 1)]
