"""Request policies without a model: beams fork, share, copy on write and drop exactly, and a
beam search gives the same beams whatever the budget, the pool and the preemptions.

A fake model stands in for the runner: a sequence's next-token logprobs are a fixed random
function of its tokens.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pagedjax.core.batch import ModelOutput
from pagedjax.core.beam_search import BeamSearch, BeamSearchParams
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.request_policy import PolicyContext, RequestPolicy
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.scheduler_output import SampledTokens
from pagedjax.core.sequence import Sequence
from pagedjax.core.stopping import StopChecker
from pagedjax.outputs import RequestOutput

BS, VOCAB, EOS, TOP = 4, 40, 0, 20


def fake_logprobs(tokens: list[int]) -> np.ndarray:
    """[VOCAB] log-softmax of logits that depend on every token (EOS a bit likelier)."""
    logits = np.random.default_rng(hash(tuple(tokens)) % 2**32).normal(0.0, 2.0, VOCAB)
    logits[EOS] += 3.0
    return (logits - np.logaddexp.reduce(logits)).astype(np.float32)


class FakeEngine:
    """Scheduler + block manager + request policies, stepped like LLMEngine.step."""

    def __init__(self, num_blocks: int, budget: int, max_num_seqs: int = 16,
                 table: dict[tuple[int, ...], np.ndarray] | None = None) -> None:
        self.scheduler = Scheduler(BlockManager(num_blocks, BS), max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=budget,
                                   stop_checker=StopChecker((EOS,), 10_000))
        ids = itertools.count()
        self.context = PolicyContext(self.scheduler, lambda: next(ids), lambda s, i: i, (EOS,),
                                     None)
        self.policies: dict[str, RequestPolicy] = {}
        self.logprobs = table  # tokens -> logprobs, when a test fixes them
        self.copies: list[list[tuple[int, int]]] = []

    def add_beam_search(self, request_id: str, prompt: list[int],
                        params: BeamSearchParams) -> BeamSearch:
        k = params.num_candidates(1)
        seq = Sequence(seq_id=self.context.new_seq_id(), request_id=request_id, index=0,
                       arrival=(len(self.policies), 0), token_ids=list(prompt),
                       num_prompt_tokens=len(prompt), sampling_params=params.sampling_params(k),
                       max_tokens=params.max_tokens, rng_seed=0)
        self.policies[request_id] = BeamSearch(seq, params, None, self.context)
        self.scheduler.add_sequence(seq)
        return self.policies[request_id]

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.copies.append(list(out.block_copies))
        by_request: dict[str, list[int]] = {}
        seqs = self.scheduler.seqs
        for i, seq_id in enumerate(out.seq_ids):
            by_request.setdefault(seqs[seq_id].request_id, []).append(i)
        # a row samples from a sequence whose tokens are all computed (its logits come from
        # all of them)
        rows = [seq_id for seq_id, end in zip(out.seq_ids, out.end_positions())
                if end == seqs[seq_id].num_tokens]
        lps = np.stack([self._logprobs(seqs[i].token_ids) for i in rows] + [np.zeros(VOCAB)])
        lps = lps[: len(rows)].astype(np.float32)
        top_ids = np.argsort(-lps, axis=1, kind="stable")[:, :TOP].astype(np.int32)
        top = np.take_along_axis(lps, top_ids, axis=1)
        output = ModelOutput(rows, top_ids[:, :1], top[:, :1], top_ids[:, None], top[:, None])
        self.scheduler.update(out, SampledTokens.from_lists(
            {i: [int(top_ids[r, 0])] for r, i in enumerate(rows)}))
        results = []
        for request_id in by_request:
            result = self.policies[request_id].update(output, {i: r for r, i in enumerate(rows)})
            if result is not None:
                results.append(result)
        return results

    def _logprobs(self, tokens: list[int]) -> np.ndarray:
        if self.logprobs is None:
            return fake_logprobs(tokens)
        return self.logprobs[tuple(tokens)]

    def run(self, max_steps: int = 500) -> dict[str, list[tuple[list[int], str]]]:
        results = {}
        for _ in range(max_steps):
            for r in self.step():
                results[r.request_id] = [(c.token_ids, c.finish_reason) for c in r.outputs]
            if not self.scheduler.has_unfinished():
                return results
        raise AssertionError(f"no progress after {max_steps} steps")

    def used_blocks(self) -> int:
        bm = self.scheduler.block_manager
        return bm.num_blocks - bm.num_free_blocks


def one_hot_logprobs(ranked: list[int]) -> np.ndarray:
    """Logprobs where ranked[0] is likeliest, then ranked[1], ... (others far below)."""
    lps = np.full(VOCAB, -30.0, np.float32)
    lps[ranked] = -np.arange(1, len(ranked) + 1, dtype=np.float32)
    return lps


def test_beams_fork_share_copy_on_write_and_drop_exactly() -> None:
    """Width 2 from a 6-token prompt (a full block and 2 tokens of the next): both beams
    continue the prompt's sequence, one as a fork; both next continuations come from beam A,
    so beam B is dropped and A forks again."""
    prompt = [1, 2, 3, 4, 5, 6]
    table = {tuple(prompt): one_hot_logprobs([10, 11, 12, 13]),  # beams A: ...10, B: ...11
             (*prompt, 10): one_hot_logprobs([20, 21, 22, 23]),  # A's two best: -2, -3
             (*prompt, 11): one_hot_logprobs([30, 31, 32, 33])}  # B's best: -2 - 1 = -3 (tie)
    table[(*prompt, 11)] -= 5.0  # B's continuations lose clearly
    engine = FakeEngine(num_blocks=16, budget=64, table=table)
    policy = engine.add_beam_search("r", prompt, BeamSearchParams(2, 3, ignore_eos=True))
    bm = engine.scheduler.block_manager

    engine.step()  # the prompt: its last position's top 2 become beams A and B
    a, b = (beam.seq for beam in policy.beams)
    prompt_blocks = list(bm.get_block_table(a.seq_id))
    assert [a.token_ids[-1], b.token_ids[-1]] == [10, 11] and b.seq_id != a.seq_id
    assert bm.get_block_table(b.seq_id) == prompt_blocks and len(prompt_blocks) == 2
    assert [bm.ref_count(x) for x in prompt_blocks] == [2, 2] and engine.used_blocks() == 2

    engine.step()  # both write position 6 into the shared partial block: A copies it
    assert engine.copies[-1] == [(prompt_blocks[1], engine.copies[-1][0][1])]
    assert [beam.seq.token_ids[-2:] for beam in policy.beams] == [[10, 20], [10, 21]]
    assert b.is_finished and b.seq_id not in engine.scheduler.seqs  # dropped
    a2 = policy.beams[1].seq  # forked off A: shares all of A's blocks
    assert bm.get_block_table(a2.seq_id) == bm.get_block_table(a.seq_id)
    assert engine.used_blocks() == 2  # B's copy went back; A and its fork share 2 blocks
    assert [score for score in (beam.score for beam in policy.beams)] == [-2.0, -3.0]


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beams_are_the_same_whatever_the_budget_pool_and_preemptions(early_stopping) -> None:
    """A roomy engine runs every beam every step. Tight ones (1-3 tokens per step; 4-6 blocks
    of 4, where 4 hold one sequence of 15 tokens) split beam groups across steps, and park the
    beams whose rows are in, so that their siblings can run, until the group picks their next
    tokens."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = BeamSearchParams(3, 10, length_penalty=1.5, early_stopping=early_stopping)

    def run(num_blocks: int, budget: int):
        engine = FakeEngine(num_blocks, budget)
        for i, prompt in enumerate(prompts):
            engine.add_beam_search(f"r{i}", prompt, params)
        results = engine.run()
        assert engine.used_blocks() == 0 and not engine.scheduler.seqs
        return results, engine.scheduler.num_preemptions_total

    roomy, num_preemptions = run(num_blocks=200, budget=512)
    assert num_preemptions == 0
    assert any(reason == "stop" for beams in roomy.values() for _, reason in beams)
    for num_blocks, budget in ((4, 1), (5, 2), (6, 3)):
        tight, num_preemptions = run(num_blocks, budget)
        assert tight == roomy and num_preemptions > 0
