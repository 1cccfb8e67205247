"""SuffixDecodingProposer against a brute-force matcher that rescans every earlier occurrence
of every suffix of the request, in its own tokens and in the cached outputs."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from pagedjax.core.suffix_proposer import SuffixDecodingProposer


def occurrences(sources: Sequence[Sequence[int]], pattern: Sequence[int]) -> Counter:
    """How often `pattern` occurs in `sources` (None), and how often each token follows it."""
    counts: Counter = Counter()
    n = len(pattern)
    for source in sources:
        for start in range(len(source) - n + 1):
            if list(source[start:start + n]) == list(pattern):
                counts[None] += 1
                if start + n < len(source):
                    counts[source[start + n]] += 1
    return counts


def substring_counts(sources: list[list[int]], depth: int) -> Counter:
    return Counter(tuple(source[start:start + n]) for source in sources
                   for n in range(1, depth + 1) for start in range(len(source) - n + 1))


def tree_counts(tree, depth: int) -> Counter:
    """Every substring a _SuffixTree counts, its implicit (seen-once) descendants included."""
    counts: Counter = Counter()
    stack = [(child, (token,)) for token, child in tree.root.children.items()]
    while stack:
        node, path = stack.pop()
        counts[path] = node.count
        if node.children is None:
            assert node.count == 1
            for token in node.seq[node.pos:node.pos + depth - len(path)]:
                path += (token,)
                counts[path] = 1
        else:
            stack += [(child, path + (token,)) for token, child in node.children.items()]
    return counts


def reference_draft(tokens: list[int], sources: list[list[int]], *, depth: int, k: int,
                    factor: float, min_prob: float) -> tuple[float, list[int]]:
    """For each suffix length m in 1..min(len, depth - 1) that occurs: extend greedily with the
    most frequent continuation (ties to the smallest token) while the product of
    count(continuation) / count(pattern) stays >= min_prob, the pattern fits `depth`, and the
    draft is shorter than min(k, floor(factor * m)); the highest sum of probabilities wins,
    ties to the longer m."""
    best: tuple[float, list[int]] = (0.0, [])
    for m in range(1, min(len(tokens), depth - 1) + 1):
        pattern = tokens[len(tokens) - m:]
        if not occurrences(sources, pattern)[None]:
            break
        limit = min(k, int(factor * m + 1e-6))
        prob, score, draft = 1.0, 0.0, []
        while len(draft) < limit and len(pattern) < depth:
            counts = occurrences(sources, pattern)
            follows = [t for t in counts if t is not None]
            if not follows:
                break
            token = min(follows, key=lambda t: (-counts[t], t))
            prob *= counts[token] / counts[None]
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            pattern = pattern + [token]
        if score >= best[0]:
            best = (score, draft)
    return best


def reference_propose(tokens: list[int], cached: list[list[int]], **kwargs) -> list[int]:
    """The request's own best draft unless the cached outputs' scores higher."""
    own = reference_draft(tokens, [tokens], **kwargs)
    other = reference_draft(tokens, cached, **kwargs) if cached else (0.0, [])
    return other[1] if other[0] > own[0] else own[1]


class Model:
    """The proposer and the plain lists the reference reads, driven together."""

    def __init__(self, *, depth: int, max_cached: int, factor: float, min_prob: float) -> None:
        self.proposer = SuffixDecodingProposer(max_tree_depth=depth, max_cached_requests=max_cached,
                                               max_spec_factor=factor, min_token_prob=min_prob)
        self.kwargs = dict(depth=depth, factor=factor, min_prob=min_prob)
        self.max_cached = max_cached
        self.tokens: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.cached: list[list[int]] = []
        self.num_outputs = 0  # finished requests with an output

    def start(self, seq_id: int, prompt: list[int]) -> None:
        self.proposer.start(seq_id, prompt)
        self.tokens[seq_id], self.prompt_len[seq_id] = list(prompt), len(prompt)

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        self.proposer.extend(seq_id, tokens)
        self.tokens[seq_id] += tokens

    def stop(self, seq_id: int) -> None:
        depth = self.kwargs["depth"]
        tree = self.proposer._requests[seq_id].tree
        assert tree_counts(tree, depth) == substring_counts([self.tokens[seq_id]], depth)
        self.proposer.stop(seq_id)
        output = self.tokens.pop(seq_id)[self.prompt_len.pop(seq_id):]
        self.num_outputs += bool(output)
        if output and self.max_cached:
            self.cached = (self.cached + [output])[-self.max_cached:]

    def check(self, seq_id: int, k: int) -> list[int]:
        got = self.proposer.propose(seq_id, k)
        assert got == reference_propose(self.tokens[seq_id], self.cached, k=k, **self.kwargs)
        return got


def random_tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("depth, factor, min_prob", [
    (2, 1.0, 0.1), (4, 1.0, 0.1), (8, 0.5, 0.0), (8, 2.0, 0.3), (24, 1.0, 0.1)])
def test_own_tokens_match_the_brute_force(depth: int, factor: float, min_prob: float) -> None:
    """One request at a time, no global cache: drafts after start and after every extend."""
    rng = random.Random(depth * 100 + int(factor * 10))
    model = Model(depth=depth, max_cached=0, factor=factor, min_prob=min_prob)
    nonempty = 0
    for seq_id in range(3):
        vocab = rng.choice([2, 3, 5])
        model.start(seq_id, random_tokens(rng, vocab, rng.randrange(0, 20)))
        nonempty += bool(model.check(seq_id, rng.randrange(1, 9)))
        for _ in range(12):
            model.extend(seq_id, random_tokens(rng, vocab, rng.randrange(1, 4)))
            nonempty += bool(model.check(seq_id, rng.randrange(1, 9)))
        model.stop(seq_id)
    assert nonempty > 10  # the comparison saw real drafts


@pytest.mark.parametrize("max_cached", [1, 3, 100])
def test_cached_outputs_match_the_brute_force(max_cached: int) -> None:
    """Interleaved requests; finished outputs feed the others' drafts, oldest evicted."""
    rng = random.Random(max_cached)
    model = Model(depth=6, max_cached=max_cached, factor=1.0, min_prob=0.1)
    live: list[int] = []
    global_wins = 0
    for seq_id in range(24):
        model.start(seq_id, random_tokens(rng, 4, rng.randrange(0, 6)))
        live.append(seq_id)
        for _ in range(3):
            target = rng.choice(live)
            model.extend(target, random_tokens(rng, 4, rng.randrange(1, 5)))
            k = rng.randrange(1, 7)
            got = model.check(target, k)
            own = reference_draft(model.tokens[target], [model.tokens[target]], k=k,
                                  **model.kwargs)
            global_wins += bool(got) and got != own[1]
        if len(live) > 3:
            model.stop(live.pop(rng.randrange(len(live))))
    assert model.proposer.num_cached_requests == len(model.cached)
    assert tree_counts(model.proposer._global, 6) == substring_counts(model.cached, 6)
    assert len(model.cached) == min(max_cached, model.num_outputs)  # evicted past the bound
    assert global_wins > 0  # some drafts came from the cached outputs


def test_a_cached_output_drafts_for_another_request_until_evicted() -> None:
    proposer = SuffixDecodingProposer(max_cached_requests=2)
    proposer.start(0, [1, 2])
    proposer.extend(0, [7, 8, 9, 10])
    proposer.start(1, [7, 8])
    assert proposer.propose(1, 4) == []  # request 0 is still running: not cached yet
    proposer.stop(0)
    assert proposer.propose(1, 4) == [9, 10]  # match [7, 8]: at most 2 drafts
    for seq_id in (2, 3):
        proposer.start(seq_id, [])
        proposer.extend(seq_id, [seq_id + 20])
        proposer.stop(seq_id)
    assert proposer.num_cached_requests == 2
    assert proposer.propose(1, 4) == []  # request 0's output was the oldest


def test_an_evicted_output_leaves_nothing_in_the_global_tree() -> None:
    proposer = SuffixDecodingProposer(max_tree_depth=4, max_cached_requests=1)
    for seq_id, output in enumerate([[1, 2, 1, 2, 3], [4, 4, 4], []]):
        proposer.start(seq_id, [9])
        proposer.extend(seq_id, output)
        proposer.stop(seq_id)
    assert proposer.num_cached_requests == 1  # [] is not cached
    proposer.start(9, [4, 4])
    # cached [4, 4, 4]: match [4] (3 times, twice followed by 4) beats the own 1/2
    assert proposer.propose(9, 3) == [4]
    assert tree_counts(proposer._global, 4) == substring_counts([[4, 4, 4]], 4)


def test_extend_after_start_drafts_from_the_whole_context() -> None:
    proposer = SuffixDecodingProposer()
    proposer.start(5, [1, 2, 3, 1, 2])
    # match [1, 2] (twice, once followed by 3): 3 at 1/2, then 1 at 1/2; 2 drafts at most
    assert proposer.propose(5, 8) == [3, 1]
    proposer.extend(5, [3])
    assert proposer.propose(5, 8) == [1, 2, 3]  # match [1, 2, 3]
    assert proposer.propose(5, 2) == [1, 2]  # max_spec_tokens cut


def test_min_token_prob_and_max_spec_factor_cut_the_draft() -> None:
    """[1, 2, 3, 4] * 3 + [1, 2, 3], depth 8. Best by default: match [4, 1, 2, 3] (3 times,
    twice followed by 4), then one path: 4 tokens at 2/3 each (score 8/3). Factor 0.5: 2
    drafts at most, from match lengths 4..6, ties to the longest: [4, 1]. min_token_prob 0.75
    drops every 2/3 and keeps what is at the threshold: match [1, 2, 3] (4 times, 3 followed
    by 4): 3/4 each, floor(1 * 3) = 3 tokens. min_token_prob 0.8: every first step is at
    most 3/4."""
    tokens = [1, 2, 3, 4] * 3 + [1, 2, 3]
    for kwargs, expected in [({}, [4, 1, 2, 3]), ({"max_spec_factor": 0.5}, [4, 1]),
                             ({"min_token_prob": 0.75}, [4, 1, 2]),
                             ({"min_token_prob": 0.8}, [])]:
        proposer = SuffixDecodingProposer(max_tree_depth=8, **kwargs)
        proposer.start(0, tokens)
        assert proposer.propose(0, 8) == expected, kwargs


def test_nothing_matches_gives_no_draft() -> None:
    proposer = SuffixDecodingProposer()
    proposer.start(0, [])
    assert proposer.propose(0, 4) == []
    proposer.extend(0, [1, 2, 3, 4])
    assert proposer.propose(0, 4) == []  # the last token never occurred before
    proposer.extend(0, [1])
    assert proposer.propose(0, 4) == [2]
    assert proposer.propose(0, 0) == []


def test_stop_frees_the_request() -> None:
    proposer = SuffixDecodingProposer(max_cached_requests=0)
    proposer.start(1, [5, 6, 7, 5, 6])
    assert proposer.propose(1, 4) == [7, 5]
    proposer.stop(1)
    for call in (lambda: proposer.propose(1, 4), lambda: proposer.extend(1, [5]),
                 lambda: proposer.stop(1)):
        with pytest.raises(ValueError, match="seq_id=1 "):
            call()
    proposer.start(1, [5, 6])  # the id is free again, with a fresh tree
    assert proposer.propose(1, 4) == []
    assert proposer.num_cached_requests == 0


@pytest.mark.parametrize("kwargs, named", [
    ({"max_tree_depth": 1}, "max_tree_depth=1"), ({"max_tree_depth": 4.0}, "max_tree_depth=4.0"),
    ({"max_cached_requests": -1}, "max_cached_requests=-1"),
    ({"max_spec_factor": 0.0}, "max_spec_factor=0.0"),
    ({"max_spec_factor": float("inf")}, "max_spec_factor=inf"),
    ({"min_token_prob": 1.5}, "min_token_prob=1.5"),
    ({"min_token_prob": -0.1}, "min_token_prob=-0.1")])
def test_bad_settings_raise(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SuffixDecodingProposer(**kwargs)


def test_bad_calls_raise() -> None:
    proposer = SuffixDecodingProposer()
    proposer.start(3, [1])
    with pytest.raises(ValueError, match="seq_id=3 is already started"):
        proposer.start(3, [1])
    with pytest.raises(ValueError, match="seq_id=4 "):
        proposer.propose(4, 2)
    for k in (-1, 2.0):
        with pytest.raises(ValueError, match=f"max_spec_tokens={k}"):
            proposer.propose(3, k)
