"""BlockManager: exact block ids and free-queue order, fork/copy-on-write, a stateful model."""

import copy
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedjax.core import block_manager
from pagedjax.core.block_manager import BlockManager


def run_prompt(bm: BlockManager, seq_id: int, token_ids: list[int]) -> list[int]:
    """Admit a seq as the scheduler does: prefix hits, allocate the rest, compute it, cache it."""
    hits = bm.get_computed_blocks(token_ids)
    num_computed = len(hits) * bm.block_size
    copies = bm.allocate_slots(seq_id, num_computed, len(token_ids) - num_computed, hits)
    assert copies == []
    bm.cache_blocks(seq_id, token_ids, len(token_ids))
    return hits


# ---------------------------------------------------------------- construction and errors
def test_user_errors_raise_value_error() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size must be positive, got -1"):
        BlockManager(4, -1)
    bm = BlockManager(8, 4)
    run_prompt(bm, 0, list(range(9)))
    hits = bm.get_computed_blocks(list(range(9)))
    assert hits == [0, 1]
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots(1, 0, -1)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_slots(0, 8, 1, hits)
    with pytest.raises(ValueError, match="len\\(computed_blocks\\) \\* block_size = 8"):
        bm.allocate_slots(1, 4, 5, hits)
    with pytest.raises(ValueError, match="free it"):
        bm.fork(0, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate(0, -1)


# ---------------------------------------------------------------- allocation and free-queue order
def test_fresh_pool_allocates_from_the_head_in_order() -> None:
    bm = BlockManager(10, 4)
    assert bm.free_block_ids() == list(range(10))
    assert bm.allocate_slots(0, 0, 10) == []
    assert bm.get_block_table(0) == [0, 1, 2]
    assert bm.allocate_slots(1, 0, 5) == []
    assert bm.get_block_table(1) == [3, 4]
    assert bm.allocate_slots(0, 10, 2) == []  # 12 slots still fit in 3 blocks
    assert bm.get_block_table(0) == [0, 1, 2]
    assert bm.allocate_slots(0, 12, 1) == []
    assert bm.get_block_table(0) == [0, 1, 2, 5]
    assert bm.free_block_ids() == [6, 7, 8, 9]
    assert bm.num_free_blocks == 4
    assert [bm.ref_count(b) for b in range(10)] == [1] * 6 + [0] * 4
    assert bm.get_block_table(42) == []


def test_free_appends_blocks_in_reverse_order() -> None:
    bm = BlockManager(10, 4)
    bm.allocate_slots(0, 0, 10)
    bm.allocate_slots(1, 0, 5)
    bm.free(0)
    assert bm.free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 0]
    bm.free(1)
    assert bm.free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert bm.get_block_table(0) == []
    bm.free(0)  # unknown seq: no-op
    bm.free(123)
    assert bm.num_free_blocks == 10
    assert all(bm.ref_count(b) == 0 for b in range(10))
    assert bm.allocate_slots(2, 0, 8) == []
    assert bm.get_block_table(2) == [5, 6]


# ---------------------------------------------------------------- prefix caching
def test_prefix_hit_takes_free_cached_blocks_from_the_middle_of_the_queue() -> None:
    bm = BlockManager(10, 4)
    prompt = list(range(10))
    assert run_prompt(bm, 0, prompt) == []
    assert bm.get_block_table(0) == [0, 1, 2]
    bm.free(0)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    other = prompt[:8] + [77, 78]
    hits = bm.get_computed_blocks(other)
    assert hits == [0, 1]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]  # lookup changes nothing
    assert bm.allocate_slots(1, 8, 2, hits) == []
    assert bm.get_block_table(1) == [0, 1, 3]
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    assert (bm.ref_count(0), bm.ref_count(1), bm.ref_count(3)) == (1, 1, 1)

    # A hit on blocks in use shares them instead.
    assert run_prompt(bm, 2, other) == [0, 1]
    assert bm.get_block_table(2) == [0, 1, 4]
    assert (bm.ref_count(0), bm.ref_count(1)) == (2, 2)
    assert bm.free_block_ids() == [5, 6, 7, 8, 9, 2]


def test_lru_evicts_the_oldest_free_cached_block_and_its_hash_stops_hitting() -> None:
    bm = BlockManager(6, 2)
    run_prompt(bm, 0, [1, 2, 3])  # blocks [0, 1]; block 0 = (1, 2) cached
    run_prompt(bm, 1, [5, 6, 7])  # blocks [2, 3]; block 2 = (5, 6) cached
    bm.free(0)
    bm.free(1)
    assert bm.free_block_ids() == [4, 5, 1, 0, 3, 2]
    bm.allocate_slots(2, 0, 5)  # three uncached blocks: 4, 5, 1
    assert bm.get_block_table(2) == [4, 5, 1]
    assert bm.get_computed_blocks([1, 2, 3]) == [0]
    bm.allocate_slots(3, 0, 1)  # takes block 0, the oldest free cached block: evicted
    assert bm.get_block_table(3) == [0]
    assert bm.free_block_ids() == [3, 2]
    assert bm.get_computed_blocks([1, 2, 3]) == []
    assert bm.get_computed_blocks([5, 6, 7]) == [2]


def test_freeing_tail_first_evicts_a_sequence_tail_before_its_head() -> None:
    bm = BlockManager(3, 2)
    run_prompt(bm, 0, [1, 2, 3, 4, 5])  # blocks [0, 1, 2]; 0 and 1 cached
    bm.free(0)
    assert bm.free_block_ids() == [2, 1, 0]
    bm.allocate_slots(1, 0, 3)  # takes 2 (uncached), then 1: evicts (3, 4)
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == [0]


def test_hit_chain_stops_at_the_first_mismatch() -> None:
    bm = BlockManager(10, 4)
    prompt = list(range(13))
    run_prompt(bm, 0, prompt)
    assert bm.get_computed_blocks(prompt) == [0, 1, 2]
    # Block 1 differs; block 2's tokens still match but its chain hash (parent) does not.
    assert bm.get_computed_blocks(prompt[:4] + [99, 5, 6, 7] + prompt[8:]) == [0]
    assert bm.get_computed_blocks([99] + prompt[1:]) == []


def test_hits_never_cover_the_last_token() -> None:
    bm = BlockManager(10, 4)
    prompt = list(range(12))
    run_prompt(bm, 0, prompt + [12])  # three full blocks cached
    assert bm.get_computed_blocks(prompt) == [0, 1]  # (12 - 1) // 4
    assert bm.get_computed_blocks(prompt + [12]) == [0, 1, 2]
    assert bm.get_computed_blocks(prompt[:5]) == [0]
    assert bm.get_computed_blocks(prompt[:4]) == []
    assert bm.get_computed_blocks([]) == []


def test_only_computed_full_blocks_are_cached() -> None:
    bm = BlockManager(10, 4)
    prompt = list(range(11))
    bm.allocate_slots(0, 0, 11)
    bm.cache_blocks(0, prompt, 7)  # chunked prefill: 7 of 11 tokens computed
    assert bm.get_computed_blocks(prompt + [0]) == [0]
    bm.cache_blocks(0, prompt, 11)
    assert bm.get_computed_blocks(prompt + [0]) == [0, 1]


def test_hash_collision_is_caught_by_the_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "_chain_hash", lambda parent_hash, token_ids: 7)
    bm = BlockManager(10, 4)
    run_prompt(bm, 0, [1, 2, 3, 4, 5])
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == [0]
    assert bm.get_computed_blocks([9, 9, 9, 9, 5]) == []
    # The second block with hash 7 stays unregistered: the map keeps block 0.
    run_prompt(bm, 1, [9, 9, 9, 9, 5])
    assert bm.get_block_table(1) == [2, 3]
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == [0]
    assert bm.get_computed_blocks([9, 9, 9, 9, 5]) == []


def test_duplicate_content_stays_unregistered_and_frees_plainly() -> None:
    bm = BlockManager(6, 2)
    bm.allocate_slots(0, 0, 3)
    bm.allocate_slots(1, 0, 3)  # same prompt computed twice at once (no hit yet)
    bm.cache_blocks(0, [1, 2, 3], 3)
    bm.cache_blocks(1, [1, 2, 3], 3)
    assert bm.get_computed_blocks([1, 2, 3]) == [0]
    bm.free(0)
    bm.free(1)
    assert bm.get_computed_blocks([1, 2, 3]) == [0]


def test_draft_marks_cover_registered_blocks_the_draft_computed_until_evicted() -> None:
    """cache_draft_blocks marks the leading blocks the draft computed that are registered (a
    duplicate's copy stays unmarked); a hit's draft blocks are the leading marked ones; an
    evicted block loses its mark, and a rolled-back seq marks its rewritten blocks again."""
    bm = BlockManager(8, 2)
    run_prompt(bm, 0, [1, 2, 3, 4, 5])  # blocks [0, 1, 2]; 0 and 1 registered
    bm.allocate_slots(1, 0, 3)  # the same prompt head computed at once: block 3 a duplicate
    bm.cache_blocks(1, [1, 2, 3], 3)
    bm.cache_draft_blocks(1, 3)
    assert bm.num_draft_computed_blocks(bm.get_computed_blocks([1, 2, 3, 4, 5])) == 0
    bm.cache_draft_blocks(0, 3)  # the draft computed 3 of the 4 cached tokens: block 0
    hits = bm.get_computed_blocks([1, 2, 3, 4, 5])
    assert hits == [0, 1] and bm.num_draft_computed_blocks(hits) == 1
    bm.cache_draft_blocks(0, 5)
    assert bm.num_draft_computed_blocks(hits) == 2
    bm.truncate(0, 2)  # rolled back to block 0: block 1 leaves seq 0 (its mark stays: cached)
    bm.allocate_slots(0, 2, 2)
    bm.cache_blocks(0, [1, 2, 9, 9], 4)  # rewritten: a new block, unmarked until the draft
    assert bm.num_draft_computed_blocks(bm.get_computed_blocks([1, 2, 9, 9, 9])) == 1
    bm.cache_draft_blocks(0, 4)
    assert bm.num_draft_computed_blocks(bm.get_computed_blocks([1, 2, 9, 9, 9])) == 2
    bm.free(0)
    bm.free(1)
    bm.allocate_slots(2, 0, 16)  # every block: the cached ones evicted, their marks gone
    bm.free(2)
    run_prompt(bm, 3, [1, 2, 3])
    assert bm.num_draft_computed_blocks(bm.get_computed_blocks([1, 2, 3])) == 0


def test_prefix_cache_metrics_count_tokens() -> None:
    bm = BlockManager(10, 4)
    run_prompt(bm, 0, list(range(10)))  # queries 10, hits 0
    run_prompt(bm, 1, list(range(10)))  # queries 10, hits 8
    bm.get_computed_blocks([5, 5, 5])  # queries 3, hits 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (23, 8)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    assert run_prompt(bm, 0, list(range(10))) == []
    bm.free(0)
    assert bm.get_computed_blocks(list(range(10))) == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


# ---------------------------------------------------------------- fork and copy-on-write
def test_fork_shares_blocks_and_appending_to_a_shared_partial_block_copies_it() -> None:
    bm = BlockManager(10, 4)
    bm.allocate_slots(0, 0, 6)
    bm.fork(0, 1)
    assert bm.get_block_table(1) == [0, 1]
    assert (bm.ref_count(0), bm.ref_count(1)) == (2, 2)

    assert bm.allocate_slots(1, 6, 1) == [(1, 2)]  # child writes slot 6 in shared block 1
    assert bm.get_block_table(1) == [0, 2]
    assert bm.get_block_table(0) == [0, 1]
    assert [bm.ref_count(b) for b in range(3)] == [2, 1, 1]
    assert bm.allocate_slots(0, 6, 1) == []  # parent now owns block 1 alone: write in place
    assert bm.get_block_table(0) == [0, 1]

    assert bm.allocate_slots(1, 7, 3) == []  # full shared block 0 is not written: no copy
    assert bm.get_block_table(1) == [0, 2, 3]
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9]

    bm.free(0)
    assert [bm.ref_count(b) for b in range(4)] == [1, 0, 1, 1]
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 1]
    bm.free(1)
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 1, 3, 2, 0]


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(10, 4)
    bm.allocate_slots(0, 0, 8)
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert [bm.ref_count(b) for b in range(2)] == [3, 3]
    assert bm.allocate_slots(1, 8, 1) == []
    assert bm.get_block_table(1) == [0, 1, 2]


def test_one_step_writing_several_shared_blocks_copies_each() -> None:
    bm = BlockManager(10, 4)
    bm.allocate_slots(0, 0, 8)
    bm.fork(0, 1)
    assert bm.allocate_slots(1, 2, 6) == [(0, 2), (1, 3)]
    assert bm.get_block_table(1) == [2, 3]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 1]


def test_copying_fork_hands_its_copies_to_the_childs_next_allocation() -> None:
    """The no-sharing baseline: the child owns copies from the start; the runner gets the
    copies with its next allocation, and until then the blocks copied from stay referenced."""
    bm = block_manager.CopyingBlockManager(10, 4)
    bm.allocate_slots(0, 0, 6)
    bm.fork(0, 1)
    assert bm.get_block_table(1) == [2, 3]
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    bm.free(0)  # the parent ends first: its blocks wait for the copies
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 1]
    assert bm.allocate_slots(1, 6, 1) == [(0, 2), (1, 3)]  # no copy-on-write: nothing shared
    assert [bm.ref_count(b) for b in range(4)] == [0, 0, 1, 1]
    assert bm.allocate_slots(1, 7, 1) == []
    bm.fork(1, 2)
    bm.free(2)  # freed before its copies ran: they are dropped, the sources released
    assert bm.num_free_blocks == 8 and [bm.ref_count(b) for b in (2, 3)] == [1, 1]
    small = block_manager.CopyingBlockManager(3, 4)
    small.allocate_slots(0, 0, 8)
    with pytest.raises(RuntimeError, match="1 free blocks, too few to copy 2"):
        small.fork(0, 1)


def test_fork_inherits_hashing_progress() -> None:
    bm = BlockManager(10, 2)
    prompt = [1, 2, 3, 4, 5]
    run_prompt(bm, 0, prompt)
    bm.fork(0, 1)
    bm.free(0)
    tokens = prompt + [6]
    assert bm.allocate_slots(1, 5, 1) == []
    bm.cache_blocks(1, tokens, 6)  # hashes only block 2, chained on the inherited hashes
    assert bm.get_computed_blocks(tokens + [7]) == [0, 1, 2]


# ---------------------------------------------------------------- no fit: None and no change
def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    bm = BlockManager(4, 4)
    bm.allocate_slots(0, 0, 12)
    before = copy.deepcopy(vars(bm))
    assert bm.allocate_slots(1, 0, 5) is None
    assert bm.allocate_slots(0, 12, 5) is None
    assert vars(bm) == before
    assert bm.allocate_slots(0, 12, 4) == []


def test_copy_on_write_copies_count_against_the_free_blocks() -> None:
    bm = BlockManager(3, 4)
    bm.allocate_slots(0, 0, 6)
    bm.fork(0, 1)
    before = copy.deepcopy(vars(bm))
    assert bm.allocate_slots(1, 6, 3) is None  # one copy + one new block > one free block
    assert vars(bm) == before
    assert bm.allocate_slots(1, 6, 2) == [(1, 2)]


def test_free_prefix_hits_count_against_the_free_blocks() -> None:
    bm = BlockManager(4, 4)
    prompt = list(range(9))
    run_prompt(bm, 0, prompt)
    bm.free(0)
    bm.allocate_slots(1, 0, 8)  # takes the uncached 3 and 2
    assert bm.free_block_ids() == [1, 0]
    hits = bm.get_computed_blocks(prompt)
    assert hits == [0, 1]
    before = copy.deepcopy(vars(bm))
    assert bm.allocate_slots(2, 8, 1, hits) is None  # 2 hits in the queue + 1 new block > 2
    assert vars(bm) == before
    bm.free(1)
    assert bm.free_block_ids() == [1, 0, 2, 3]
    assert bm.allocate_slots(2, 8, 1, hits) == []
    assert bm.get_block_table(2) == [0, 1, 2]
    assert bm.free_block_ids() == [3]


# ---------------------------------------------------------------- truncate (speculative rollback)
def test_truncate_frees_exactly_the_blocks_past_the_length() -> None:
    bm = BlockManager(10, 4)
    bm.allocate_slots(0, 0, 16)
    bm.truncate(0, 9)
    assert bm.get_block_table(0) == [0, 1, 2]
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 3]
    bm.truncate(0, 9)
    assert bm.get_block_table(0) == [0, 1, 2]
    bm.truncate(0, 1)
    assert bm.get_block_table(0) == [0]
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    bm.truncate(0, 0)
    assert bm.get_block_table(0) == []
    assert bm.num_free_blocks == 10
    bm.truncate(77, 3)  # unknown seq: no-op


def test_truncate_then_rewrite_replaces_the_stale_cache_entry() -> None:
    bm = BlockManager(10, 2)
    run_prompt(bm, 0, [1, 2, 3, 4, 5])  # blocks [0, 1, 2]; (1, 2) and (3, 4) cached
    bm.truncate(0, 3)  # keep [0, 1]; block 1 now holds only token 3
    assert bm.get_block_table(0) == [0, 1]
    assert bm.allocate_slots(0, 3, 2) == []  # rewrites slot 3 of block 1 in place
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == [0]
    bm.cache_blocks(0, [1, 2, 3, 8, 9], 5)
    assert bm.get_computed_blocks([1, 2, 3, 8, 9]) == [0, 1]


def test_rollback_without_truncate_rehashes_the_rewritten_blocks() -> None:
    bm = BlockManager(10, 2)
    run_prompt(bm, 0, [1, 2, 3, 4, 5, 6, 7])  # blocks [0, 1, 2, 3]; 0, 1, 2 cached
    assert bm.allocate_slots(0, 3, 3) == []  # num_computed_tokens rolled back 6 -> 3, same blocks
    new = [1, 2, 3, 8, 9, 10, 11]
    bm.cache_blocks(0, new, 6)
    assert bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7]) == [0]
    assert bm.get_computed_blocks(new) == [0, 1, 2]


def test_truncate_a_shared_block_then_rewrite_copies_and_keeps_the_cache() -> None:
    bm = BlockManager(10, 2)
    run_prompt(bm, 0, [1, 2, 3, 4, 5])
    bm.fork(0, 1)
    bm.truncate(1, 3)
    assert bm.get_block_table(1) == [0, 1]
    assert bm.ref_count(2) == 1
    assert bm.allocate_slots(1, 3, 1) == [(1, 3)]
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == [0, 1]


# ---------------------------------------------------------------- stateful model check

BLOCK_SIZE = 2
NUM_BLOCKS = 16
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=10)  # tiny vocab: prefixes repeat


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler + runner, tracking what each block's KV slots hold."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs: dict[int, tuple[list[int], int]] = {}  # seq id -> (token ids, num computed)
        self.content: defaultdict[int, list] = defaultdict(lambda: [None] * BLOCK_SIZE)
        self.next_id = 0

    def _step(
        self, seq_id: int, tokens: list[int], num_computed: int, num_new: int, hits=()
    ) -> bool:
        """One step: allocate, run (copy, then write KV), cache. False if it did not fit."""
        before = copy.deepcopy(vars(self.bm))
        copies = self.bm.allocate_slots(seq_id, num_computed, num_new, hits)
        if copies is None:
            assert vars(self.bm) == before
            return False
        table = self.bm.get_block_table(seq_id)
        for src, dst in copies:
            assert src not in table and dst in table
            self.content[dst] = list(self.content[src])
        for pos in range(num_computed, num_computed + num_new):
            self.content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = tokens[pos]
        self.bm.cache_blocks(seq_id, tokens, num_computed + num_new)
        self.seqs[seq_id] = (tokens, num_computed + num_new)
        return True

    def _admit(self, seq_id: int, tokens: list[int], chunk: int) -> None:
        hits = self.bm.get_computed_blocks(tokens)
        assert len(hits) <= (len(tokens) - 1) // BLOCK_SIZE
        for i, block_id in enumerate(hits):
            assert self.content[block_id] == tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        num_computed = len(hits) * BLOCK_SIZE
        num_new = min(chunk, len(tokens) - num_computed)
        if not self._step(seq_id, tokens, num_computed, num_new, hits):
            assert self.bm.get_block_table(seq_id) == []

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.seqs)))

    @rule(tokens=tokens_st, chunk=st.integers(1, 10))
    def add(self, tokens: list[int], chunk: int) -> None:
        self.next_id += 1
        self._admit(self.next_id, tokens, chunk)

    def _append(self, seq_id: int, new: list[int], chunk: int) -> None:
        tokens, num_computed = self.seqs[seq_id]
        tokens = tokens + new if new or num_computed < len(tokens) else tokens + [0]
        if not self._step(seq_id, tokens, num_computed, min(chunk, len(tokens) - num_computed)):
            self.bm.free(seq_id)  # the scheduler preempts
            del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), max_size=3), chunk=st.integers(1, 4))
    def append(self, data: st.DataObject, new: list[int], chunk: int) -> None:
        self._append(self._pick(data), new, chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 1))
    def fork(self, data: st.DataObject, token: int) -> None:
        """Parallel sampling: the child shares the parent's blocks, then samples its own token."""
        parent = self._pick(data)
        self.next_id += 1
        self.bm.fork(parent, self.next_id)
        tokens, num_computed = self.seqs[parent]
        self.seqs[self.next_id] = (list(tokens), num_computed)
        self._append(self.next_id, [token], 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self._pick(data)
        self.bm.free(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 10))
    def preempt(self, data: st.DataObject, chunk: int) -> None:
        """Free a running seq and readmit it (recompute), hitting its own freed cached blocks."""
        seq_id = self._pick(data)
        tokens, _ = self.seqs.pop(seq_id)
        self.bm.free(seq_id)
        if tokens:  # a seq truncated to nothing has nothing to recompute
            self._admit(seq_id, tokens, chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), num_tokens=st.integers(0, 12))
    def truncate(self, data: st.DataObject, num_tokens: int) -> None:
        seq_id = self._pick(data)
        tokens, num_computed = self.seqs[seq_id]
        num_tokens = min(num_tokens, len(tokens))
        self.bm.truncate(seq_id, num_tokens)
        self.seqs[seq_id] = (tokens[:num_tokens], min(num_computed, num_tokens))

    @invariant()
    def pool_is_consistent(self) -> None:
        held = Counter(b for seq_id in self.seqs for b in self.bm.get_block_table(seq_id))
        free = self.bm.free_block_ids()
        assert len(free) == len(set(free)) == self.bm.num_free_blocks
        assert len(free) + len(held) == NUM_BLOCKS
        assert set(free) == {b for b in range(NUM_BLOCKS) if self.bm.ref_count(b) == 0}
        assert all(self.bm.ref_count(b) == held[b] for b in range(NUM_BLOCKS))

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        assert len(self.bm._hash_to_block) == len(self.bm._cached)
        for block_hash, block_id in self.bm._hash_to_block.items():
            cached_hash, token_ids = self.bm._cached[block_id]
            assert cached_hash == block_hash
            assert tuple(self.content[block_id]) == token_ids

    @invariant()
    def tables_hold_the_computed_tokens(self) -> None:
        for seq_id, (tokens, num_computed) in self.seqs.items():
            table = self.bm.get_block_table(seq_id)
            assert len(table) * BLOCK_SIZE >= num_computed
            for pos in range(num_computed):
                assert self.content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == tokens[pos]
            parent_hash = None
            for i, block_hash in enumerate(self.bm._seq_hashes[seq_id]):
                assert (i + 1) * BLOCK_SIZE <= num_computed
                block_tokens = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                parent_hash = block_manager._chain_hash(parent_hash, block_tokens)
                assert block_hash == parent_hash

    def teardown(self) -> None:
        for seq_id in list(self.seqs):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(self.bm.ref_count(b) == 0 for b in range(NUM_BLOCKS))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
