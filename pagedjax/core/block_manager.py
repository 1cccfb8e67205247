"""Paged KV block pool: reference counts, fork, copy-on-write and prefix caching.

Pure Python (no jax, torch or numpy): the scheduler talks to it in ints and lists, and the
runner only ever sees block tables and the (src, dst) copies it must perform.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence


def _chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block, chained on its parent's: equal blocks under other prefixes differ."""
    return hash((parent_hash, token_ids))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """A fixed pool of KV blocks: reference counts, fork, copy-on-write, prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"num_blocks must be positive, got {num_blocks}; give the pool >= 1 block"
            )
        if block_size <= 0:
            raise ValueError(
                f"block_size must be positive, got {block_size}; use e.g. 16 tokens per block"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # tokens looked up by get_computed_blocks
        self.prefix_cache_hits = 0  # of those, tokens found in cached blocks
        self._ref_counts = [0] * num_blocks
        # Blocks with refcount 0; head = freed longest ago = next to allocate (and evict if cached).
        # OrderedDict gives O(1) popleft, append, and removal from the middle on a prefix hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # Registered blocks: block id -> (chain hash, its token ids), checked on every hit.
        self._cached: dict[int, tuple[int, tuple[int, ...]]] = {}
        # Registered blocks whose draft-model KV is computed too (speculative decoding: the
        # draft's cache takes the same block ids), and per seq how many of its leading blocks
        # cache_draft_blocks has looked at: a hit on them spares the draft's catch-up as well.
        self._draft_cached: set[int] = set()
        self._draft_marked: dict[int, int] = {}
        self._tables: dict[int, list[int]] = {}
        # Per seq: chain hashes of its leading full blocks hashed so far (cache_blocks' progress).
        self._seq_hashes: dict[int, list[int]] = {}
        # seq id -> first index of its table changed since take_table_changes (the persistent
        # batch copies tables from there only)
        self._changed_from: dict[int, int] = {}
        # Seqs that took part in a fork: their tables may share a block they write (prefix-cache
        # hits never are: those blocks are full). Every other seq writes its own blocks only.
        self.forked: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0, cached-but-free ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def tables(self) -> Mapping[int, list[int]]:
        """seq id -> its block table (read-only for callers)."""
        return self._tables

    def get_block_table(self, seq_id: int) -> list[int]:
        """The seq's block ids in order (empty if it has none). Read-only for callers."""
        return self._tables.get(seq_id, [])

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding block_id."""
        return self._ref_counts[block_id]

    def take_table_changes(self) -> dict[int, tuple[int, list[int]]]:
        """seq id -> (first changed index, its table from there) of every table changed since
        the last call (grown, copied on write, truncated; a new table from index 0)."""
        changes, self._changed_from = self._changed_from, {}
        return {seq_id: (first, self._tables[seq_id][first:])
                for seq_id, first in changes.items()}

    def _mark_changed(self, seq_id: int, first: int) -> None:
        self._changed_from[seq_id] = min(first, self._changed_from.get(seq_id, first))

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to allocate or evict) first."""
        return list(self._free)

    def get_computed_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """Longest chain of cached full blocks matching token_ids' prefix; never the last token.

        Only the two prefix-cache metrics change; the caller passes the result to allocate_slots.
        """
        if not self.enable_prefix_caching:
            return []
        self.prefix_cache_queries += len(token_ids)
        bs = self.block_size
        hits: list[int] = []
        parent_hash: int | None = None
        # The last token's logits must be computed, so at most (len - 1) // bs blocks can hit.
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent_hash = _chain_hash(parent_hash, tokens)
            block_id = self._hash_to_block.get(parent_hash)
            if block_id is None or self._cached[block_id][1] != tokens:  # miss, or a hash collision
                break
            hits.append(block_id)
        self.prefix_cache_hits += len(hits) * bs
        return hits

    def allocate_slots(
        self,
        seq_id: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
    ) -> list[tuple[int, int]] | None:
        """Grow seq_id's table to cover num_computed_tokens + num_new_tokens slots.

        Returns the copy-on-write copies (src, dst) the runner must perform before writing, or None
        (with nothing changed) when the free blocks do not suffice; the scheduler then preempts.
        """
        bs = self.block_size
        table = self._tables.get(seq_id)
        num_required = _cdiv(num_computed_tokens + num_new_tokens, bs)
        if (table is not None and not computed_blocks and num_new_tokens
                and num_required <= len(table) and num_computed_tokens >= 0
                and len(self._seq_hashes[seq_id]) <= num_computed_tokens // bs):
            # The common step (a decode token in its last block): nothing to take if every
            # block it writes is its own, unhashed and uncached.
            for i in range(num_computed_tokens // bs, num_required):
                block_id = table[i]
                if self._ref_counts[block_id] > 1 or block_id in self._cached:
                    break
            else:
                return []
        self._check_allocate_args(seq_id, num_computed_tokens, num_new_tokens, computed_blocks)
        table = table or []
        # Indices of the existing blocks that cover slots written this step.
        first_written = num_computed_tokens // bs if num_new_tokens else num_required
        written = range(first_written, min(len(table), num_required))
        to_copy = [i for i in written if self._ref_counts[table[i]] > 1]
        num_new_blocks = max(0, num_required - len(table) - len(computed_blocks))
        num_free_hits = sum(1 for b in set(computed_blocks) if self._ref_counts[b] == 0)
        if num_new_blocks + len(to_copy) + num_free_hits > len(self._free):
            return None

        table = self._tables.setdefault(seq_id, [])
        hashes = self._seq_hashes.setdefault(seq_id, [])
        first_changed = len(table)
        for block_id in computed_blocks:
            self._free.pop(block_id, None)
            self._ref_counts[block_id] += 1
            table.append(block_id)
            hashes.append(self._cached[block_id][0])
        # Blocks written from here on lose their hashes (a rollback without truncate).
        del hashes[num_computed_tokens // bs :]
        copies = []
        for i in to_copy:
            src, dst = table[i], self._take_free_block()
            self._ref_counts[src] -= 1
            table[i] = dst
            copies.append((src, dst))
            first_changed = min(first_changed, i)
        for i in written:
            # Only after a rollback: the block is rewritten in place, so its cache entry goes stale.
            if table[i] in self._cached:
                self._uncache(table[i])
        table.extend(self._take_free_block() for _ in range(num_new_blocks))
        if first_changed < len(table):
            self._mark_changed(seq_id, first_changed)
        return copies

    def append_blocks(self, seq_ids: Sequence[int]) -> bool:
        """One new block at the end of each seq's table, all or none (False: too few free): the
        common step's sequences that fill their last block, allocated in one go."""
        if len(seq_ids) > len(self._free):
            return False
        tables = self._tables
        for seq_id in seq_ids:
            table = tables[seq_id]
            self._mark_changed(seq_id, len(table))
            table.append(self._take_free_block())
        return True

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register in the prefix cache each full, computed block of the seq not yet hashed."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        bs = self.block_size
        table, hashes = self._tables[seq_id], self._seq_hashes[seq_id]
        num_full = min(num_computed_tokens // bs, len(table), len(token_ids) // bs)
        for i in range(len(hashes), num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block_hash = _chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(block_hash)
            block_id = table[i]
            # First block with this content wins; a duplicate (e.g. two seqs computing one prompt at
            # once) stays unregistered and returns to the pool plainly when freed.
            if block_hash not in self._hash_to_block and block_id not in self._cached:
                self._hash_to_block[block_hash] = block_id
                self._cached[block_id] = (block_hash, tokens)

    def cache_draft_blocks(self, seq_id: int, num_draft_computed_tokens: int) -> None:
        """Mark the seq's registered blocks among its leading num_draft_computed_tokens //
        block_size as holding the draft's KV too (its blocks registered by another seq's
        duplicate computation stay unmarked: the registered copy's draft KV is that seq's)."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        table, hashes = self._tables[seq_id], self._seq_hashes[seq_id]
        end = min(num_draft_computed_tokens // self.block_size, len(hashes))
        for i in range(self._draft_marked.get(seq_id, 0), end):
            if self._hash_to_block.get(hashes[i]) == table[i]:
                self._draft_cached.add(table[i])
        self._draft_marked[seq_id] = max(end, self._draft_marked.get(seq_id, 0))

    def num_draft_computed_blocks(self, computed_blocks: Sequence[int]) -> int:
        """How many of get_computed_blocks' leading hits hold the draft's KV too."""
        for n, block_id in enumerate(computed_blocks):
            if block_id not in self._draft_cached:
                return n
        return len(computed_blocks)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Share all of the parent's blocks with the child (parallel sampling, beam search)."""
        if self._tables.get(child_seq_id):
            raise ValueError(
                f"fork: child seq {child_seq_id} already holds blocks; free it or pick a new id"
            )
        table = self._tables.get(parent_seq_id, [])
        for block_id in table:
            assert self._ref_counts[block_id] > 0, (
                f"block {block_id} of seq {parent_seq_id} is free"
            )
            self._ref_counts[block_id] += 1
        self._tables[child_seq_id] = list(table)
        self._seq_hashes[child_seq_id] = list(self._seq_hashes.get(parent_seq_id, []))
        self._mark_changed(child_seq_id, 0)
        self.forked.update((parent_seq_id, child_seq_id))

    def free(self, seq_id: int) -> None:
        """Release all of the seq's blocks (tail first, so its tail is evicted before its head)."""
        table = self._tables.pop(seq_id, None)
        self._seq_hashes.pop(seq_id, None)
        self._draft_marked.pop(seq_id, None)
        self._changed_from.pop(seq_id, None)
        self.forked.discard(seq_id)
        if table is not None:
            self._release(reversed(table))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Speculative rollback: keep only the blocks covering the first num_tokens tokens."""
        if num_tokens < 0:
            raise ValueError(f"truncate: num_tokens must be >= 0, got {num_tokens}")
        table = self._tables.get(seq_id)
        if table is None:
            return
        num_kept = _cdiv(num_tokens, self.block_size)
        released = table[num_kept:]
        if released:
            self._mark_changed(seq_id, num_kept)
        del table[num_kept:]
        self._release(reversed(released))
        del self._seq_hashes[seq_id][num_tokens // self.block_size :]
        if seq_id in self._draft_marked:
            self._draft_marked[seq_id] = min(self._draft_marked[seq_id],
                                             num_tokens // self.block_size)

    def _check_allocate_args(
        self,
        seq_id: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[int],
    ) -> None:
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(
                f"allocate_slots: token counts must be >= 0, got {num_computed_tokens=}, "
                f"{num_new_tokens=}"
            )
        if not computed_blocks:
            return
        if self._tables.get(seq_id):
            raise ValueError(
                f"allocate_slots: seq {seq_id} already holds blocks; pass computed_blocks only once"
            )
        if num_computed_tokens != len(computed_blocks) * self.block_size:
            raise ValueError(
                f"allocate_slots: num_computed_tokens={num_computed_tokens} must equal "
                f"len(computed_blocks) * block_size = {len(computed_blocks) * self.block_size}"
            )
        for block_id in computed_blocks:
            assert block_id in self._cached, f"computed block {block_id} is not in the prefix cache"

    def _take_free_block(self) -> int:
        """Pop the free queue's head (LRU), evicting its cache entry if it has one."""
        block_id, _ = self._free.popitem(last=False)
        if block_id in self._cached:
            self._uncache(block_id)
        assert self._ref_counts[block_id] == 0, (
            f"free block {block_id} has refcount {self._ref_counts[block_id]}"
        )
        self._ref_counts[block_id] = 1
        return block_id

    def _uncache(self, block_id: int) -> None:
        self._draft_cached.discard(block_id)
        block_hash, _ = self._cached.pop(block_id)
        mapped = self._hash_to_block.pop(block_hash)
        assert mapped == block_id, f"hash of block {block_id} maps to block {mapped}"

    def _release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue's tail."""
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed more often than taken"
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None


class CopyingBlockManager(BlockManager):
    """A pool whose `fork` copies every block instead of sharing it: the no-sharing baseline
    that benchmarks/memory.py measures PagedAttention's sharing against (same engine, forks
    disabled). Without speculative decoding only.

    The copies reach the runner with the child's next allocation, when the parent's KV is
    complete (an n > 1 fork happens before the prompt's step); until then the child keeps its
    reference to each block it copies from, so none is reused first.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self._pending_copies: dict[int, list[tuple[int, int]]] = {}

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        num_blocks = len(self.get_block_table(parent_seq_id))
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"the pool has {self.num_free_blocks} free blocks, too few to "
                               f"copy {num_blocks} on a fork; give the baseline more blocks")
        super().fork(parent_seq_id, child_seq_id)  # the child holds a reference to each block
        table = self._tables[child_seq_id]
        copies = [(src, self._take_free_block()) for src in table]
        table[:] = [dst for _, dst in copies]
        self._mark_changed(child_seq_id, 0)
        self._pending_copies[child_seq_id] = copies

    def allocate_slots(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[tuple[int, int]] | None:
        copies = super().allocate_slots(seq_id, num_computed_tokens, num_new_tokens,
                                        computed_blocks)
        if copies is None or seq_id not in self._pending_copies:
            return copies
        pending = self._pending_copies.pop(seq_id)
        self._release(src for src, _ in pending)  # the runner copies before this step's writes
        return pending + copies

    def free(self, seq_id: int) -> None:
        pending = self._pending_copies.pop(seq_id, None)
        if pending:
            self._release(src for src, _ in pending)
        super().free(seq_id)
