"""Suffix decoding (Arctic Inference; vLLM's speculative_config={"method": "suffix"}): drafts
read from suffix trees, no draft model.

Each request has a tree over its own tokens (prompt and output so far); one global tree holds
the outputs of the most recently finished requests. A tree counts the occurrences of every
substring of at most `max_tree_depth` tokens: a trie whose nodes seen more than once list their
children, while a node seen once only points at where its occurrence continues (Arctic's path
compression, in its simplest form), so a unique stretch of context costs one node, not one per
depth. Appending a token extends the request's "active" nodes (its suffixes seen before and
shorter than the depth limit) by one child each: O(max_tree_depth) at most, whatever the
context length; and those nodes are the request's matches in its own tree, so proposing
searches only the global tree.

Proposing, for each tree (the rules of Arctic's `SuffixTree::speculate`, path mode):

1. For every match length m = 1, 2, ... (the last m tokens of the request occur in the tree;
   at most min(len(tokens), max_tree_depth - 1)), walk greedily from the matched node: the
   next draft token is the most frequent child, ties to the smallest token id; its probability
   is the product of count(child) / count(parent) along the walk (a parent's count includes
   occurrences with no continuation, e.g. the request's own last tokens). The walk stops
   before a token whose probability is below `min_token_prob`, at a node with no child, or
   after min(max_spec_tokens, floor(max_spec_factor * m)) tokens.
2. A draft's score is the sum of its tokens' probabilities; the tree proposes the draft with
   the highest score, ties to the longer match.
3. The request's tree and the global tree compete the same way, ties to the request's tree.

Unlike Arctic, an active request's output joins the global tree only when it stops (Arctic
adds it token by token, visible to other requests at once), and a match may span a whole
context shorter than the depth limit (Arctic stops one token short).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


class _Node:
    """One substring: its last token, how often it occurs, and how it continues. A node seen
    more than once lists its one-token extensions (`children`); a node seen once holds none:
    its only occurrence continues at seq[pos:], and those tokens are its implicit descendants
    (each seen once) down to the depth limit, so a unique context costs one node, not one
    per depth. (In the global tree a node left with one occurrence by an eviction keeps its
    children.)"""

    __slots__ = ("token", "count", "children", "best", "seq", "pos")

    def __init__(self, token: int, seq: Sequence[int], pos: int) -> None:
        self.token = token
        self.count = 0
        self.children: dict[int, _Node] | None = None  # None: the continuation is seq[pos:]
        # the most frequent child (ties to the smallest token); None: none, or not known yet
        self.best: _Node | None = None
        self.seq = seq
        self.pos = pos


def _rank(node: _Node) -> tuple[int, int]:
    return -node.count, node.token


def _best_child(node: _Node) -> _Node | None:
    best = node.best
    if best is None and node.children:
        best = node.best = min(node.children.values(), key=_rank)
    return best


def _count_child(parent: _Node, child: _Node) -> None:
    """One more occurrence of `child`, an entry of parent.children."""
    child.count += 1
    best = parent.best
    if best is not None and best is not child and (child.count > best.count or (
            child.count == best.count and child.token < best.token)):
        parent.best = child


class _SuffixTree:
    """Occurrence counts of every substring of at most `max_depth` tokens of its sequences."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, (), 0)  # the empty substring (its count is not kept)
        self.root.children = {}

    def append(self, active: list[_Node], seq: Sequence[int], pos: int) -> None:
        """Counts the substrings ending at seq[pos] (the token just appended). `active`: the
        nodes with children of the substrings ending at seq[pos - 1], shortest first (the
        longer ones are implicit and grow by themselves); becomes those ending at seq[pos]."""
        token = seq[pos]
        extended = []
        for depth, parent in enumerate((self.root, *active)):
            child = parent.children.get(token)
            if child is None:
                child = parent.children[token] = _Node(token, seq, pos + 1)
                _count_child(parent, child)
                continue
            if child.children is None:  # a second occurrence: list the first one's child
                child.children = {}
                if depth + 1 < self.max_depth and child.pos < len(child.seq):
                    grandchild = _Node(child.seq[child.pos], child.seq, child.pos + 1)
                    grandchild.count = 1
                    child.children[grandchild.token] = child.best = grandchild
            _count_child(parent, child)
            extended.append(child)
        active[:] = extended[:self.max_depth - 1]

    def insert(self, seq: Sequence[int]) -> None:
        """Adds one whole sequence (kept: the tree points into it)."""
        active: list[_Node] = []
        for pos in range(len(seq)):
            self.append(active, seq, pos)

    def remove(self, seq: Sequence[int]) -> None:
        """Takes back a sequence `insert` added, deleting the substrings left with no
        occurrence (a child never outnumbers its parent, so a deleted node's subtree is empty,
        and a node with no children has one occurrence)."""
        for start in range(len(seq)):
            node = self.root
            for token in seq[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child is node.best:
                    node.best = None
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def match(self, tokens: Sequence[int]) -> list[tuple[_Node, int]]:
        """Where the suffixes of `tokens` of lengths 1, 2, ... end in the tree, up to
        max_depth - 1: (node, how many of its implicit descendants further). A suffix that
        does not occur has no longer one that does."""
        matches = []
        for length in range(1, min(len(tokens), self.max_depth - 1) + 1):
            node, offset = self.root, 0
            for token in tokens[len(tokens) - length:]:
                if node.children is not None:
                    node, offset = node.children.get(token), 0
                    if node is None:
                        return matches
                elif node.pos + offset < len(node.seq) and node.seq[node.pos + offset] == token:
                    offset += 1
                else:
                    return matches
            matches.append((node, offset))
        return matches


def _walk(node: _Node, offset: int, depth: int, limit: int, min_token_prob: float,
          max_depth: int) -> tuple[float, list[int]]:
    """The greedy draft from a match of `depth` tokens (`offset` below `node`): its score and
    its tokens."""
    prob, score, draft = 1.0, 0.0, []
    while len(draft) < limit:
        if node.children is None:  # one occurrence: its continuation, each at probability 1
            start = node.pos + offset
            for token in node.seq[start:start + min(limit - len(draft), max_depth - depth)]:
                draft.append(token)
                score += prob
            break
        child = _best_child(node)
        if child is None:
            break
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        draft.append(child.token)
        score += prob
        node, offset, depth = child, 0, depth + 1
    return score, draft


@dataclass
class _Request:
    tree: _SuffixTree  # over `tokens`
    num_prompt_tokens: int
    tokens: list[int] = field(default_factory=list)  # prompt and output so far
    active: list[_Node] = field(default_factory=list)  # see _SuffixTree.append


class SuffixDecodingProposer:
    """Suffix decoding (Arctic Inference): drafts from suffix trees over each request's own
    tokens (prompt and output so far) and over the outputs of recent finished requests.

    `extend` takes the tokens a request keeps (accepted drafts and the sampled token), never
    unverified drafts. Per call: `extend` costs O(max_tree_depth) per token at most; `propose`
    O(max_tree_depth * (max_tree_depth + max_spec_tokens)) at most; `stop` and each eviction
    O(output length * max_tree_depth) at most."""

    def __init__(self, *, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if not _is_int(max_tree_depth) or max_tree_depth < 2:
            raise ValueError(f"max_tree_depth={max_tree_depth!r} must be an integer >= 2 "
                             "(a depth-1 tree holds no continuation).")
        if not _is_int(max_cached_requests) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests={max_cached_requests!r} must be an integer "
                             ">= 0 (0: no global cache).")
        if not isinstance(max_spec_factor, (int, float)) or not (
                0 < max_spec_factor < math.inf):
            raise ValueError(f"max_spec_factor={max_spec_factor!r} must be a finite number > 0.")
        if not isinstance(min_token_prob, (int, float)) or not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob={min_token_prob!r} must be in [0, 1].")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self._requests: dict[int, _Request] = {}
        self._global = _SuffixTree(max_tree_depth)
        self._cached: deque[list[int]] = deque()  # outputs in the global tree, oldest first

    @property
    def num_cached_requests(self) -> int:
        """Finished requests whose output is in the global tree."""
        return len(self._cached)

    def start(self, seq_id: int, prompt_token_ids: Sequence[int]) -> None:
        """A new request."""
        if seq_id in self._requests:
            raise ValueError(f"seq_id={seq_id!r} is already started.")
        tokens = [int(t) for t in prompt_token_ids]
        request = _Request(_SuffixTree(self.max_tree_depth), len(tokens))
        self._requests[seq_id] = request
        self._append(request, tokens)

    def extend(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Output tokens appended to the request."""
        self._append(self._request(seq_id), [int(t) for t in token_ids])

    def stop(self, seq_id: int) -> None:
        """The request finished or was aborted: its tree is freed and its output (if any)
        joins the global cache, evicting the oldest cached output past max_cached_requests."""
        request = self._requests.pop(seq_id, None)
        if request is None:
            raise ValueError(f"seq_id={seq_id!r} is not a started request.")
        output = request.tokens[request.num_prompt_tokens:]
        if not output or self.max_cached_requests == 0:
            return
        self._global.insert(output)
        self._cached.append(output)
        while len(self._cached) > self.max_cached_requests:
            self._global.remove(self._cached.popleft())

    def propose(self, seq_id: int, max_spec_tokens: int) -> list[int]:
        """Drafts for the request's next positions: at most `max_spec_tokens`, possibly []."""
        request = self._request(seq_id)
        if not _is_int(max_spec_tokens) or max_spec_tokens < 0:
            raise ValueError(f"max_spec_tokens={max_spec_tokens!r} must be an integer >= 0.")
        if max_spec_tokens == 0:
            return []
        # the request's longer suffixes occur once (here, with nothing after): no draft
        score, draft = self._best_draft([(node, 0) for node in request.active],
                                        max_spec_tokens)
        if self._cached:
            context = request.tokens[-(self.max_tree_depth - 1):]
            global_score, global_draft = self._best_draft(self._global.match(context),
                                                          max_spec_tokens)
            if global_score > score:
                draft = global_draft
        return draft

    def _best_draft(self, matches: list[tuple[_Node, int]],
                    max_spec_tokens: int) -> tuple[float, list[int]]:
        """The highest-scoring draft over the matched suffixes (matches[m - 1]: length m),
        ties to the longer match."""
        best: tuple[float, list[int]] = (0.0, [])
        for length, (node, offset) in enumerate(matches, 1):
            limit = min(max_spec_tokens, int(self.max_spec_factor * length + 1e-6))
            if limit == 0:
                continue  # an empty draft scores 0: it never beats a non-empty one
            candidate = _walk(node, offset, length, limit, self.min_token_prob,
                              self.max_tree_depth)
            if candidate[0] >= best[0]:
                best = candidate
        return best

    def _append(self, request: _Request, tokens: list[int]) -> None:
        start = len(request.tokens)
        request.tokens += tokens  # in place: the tree points into it
        for pos in range(start, len(request.tokens)):
            request.tree.append(request.active, request.tokens, pos)

    def _request(self, seq_id: int) -> _Request:
        request = self._requests.get(seq_id)
        if request is None:
            raise ValueError(f"seq_id={seq_id!r} is not a started request.")
        return request


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
