"""Host drafts scored while the adaptive policy drafts nothing (host_drafts.ShadowDrafts)."""

from __future__ import annotations

from types import SimpleNamespace

from pagedjax.core.host_drafts import ShadowDrafts
from pagedjax.core.sequence import Sequence, SequenceStatus
from pagedjax.sampling_params import SamplingParams


def sequence(seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), 0, (seq_id, 0), list(tokens), len(tokens),
                   SamplingParams(), 64, 0)
    seq.num_computed_tokens = len(tokens) - 1  # decoding: its last token is its next input
    seq.status = SequenceStatus.RUNNING
    return seq


class ScriptedDrafter:
    """Proposes, for each sequence asked, the given drafts; records whom it was asked for."""

    def __init__(self, drafts: dict[int, list[int]]) -> None:
        self.drafts, self.asked = drafts, []

    def propose(self, scheduler, batch, k, seqs=None) -> dict[int, list[int]]:
        self.asked.append([seq.seq_id for seq in seqs])
        return {seq.seq_id: self.drafts[seq.seq_id][:k] for seq in seqs
                if self.drafts.get(seq.seq_id)}


class Recorder:
    """The policy's side: what the shadows report."""

    def __init__(self) -> None:
        self.scored, self.matching = [], []

    def observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.scored.append((num_drafts, num_accepted))

    def observe_matching(self, num_offered: int, num_proposing: int) -> None:
        self.matching.append((num_offered, num_proposing))


def decode(seq: Sequence, token: int) -> None:
    seq.token_ids.append(token)
    seq.num_computed_tokens += 1


def test_a_proposal_is_scored_by_the_prefix_its_sequence_then_decodes() -> None:
    seq = sequence(0, [1, 2, 3])
    scheduler = SimpleNamespace(seqs={0: seq}, running=[seq])
    policy = Recorder()
    shadow = ShadowDrafts(ScriptedDrafter({0: [7, 8, 9, 10]}), 4)
    shadow.step(scheduler, None, policy)
    assert shadow.pending == {0: (3, [7, 8, 9, 10])}  # the drafts of positions 3, 4, 5, 6
    for token in (7, 8, 5):
        decode(seq, token)
        shadow.step(scheduler, None, policy)
        assert not policy.scored  # not scored before it decoded as many tokens as it drafted
        assert shadow.pending == {0: (3, [7, 8, 9, 10])}  # nor replaced
    decode(seq, 10)
    shadow.step(scheduler, None, policy)
    assert policy.scored == [(4, 2)]  # 7, 8 accepted, 9 rejected (10 after it counts nothing)
    assert shadow.pending == {0: (7, [7, 8, 9, 10])}  # and it proposes again
    assert policy.matching == [(1, 1)] * 5  # it would have drafted at every step


def test_a_few_sequences_at_a_time_in_turns_and_finished_ones_dropped() -> None:
    seqs = [sequence(i, [1, 2]) for i in range(10)]
    scheduler = SimpleNamespace(seqs={s.seq_id: s for s in seqs}, running=seqs)
    drafter = ScriptedDrafter({i: [5, 6] for i in range(10) if i != 1})  # 1 finds no match
    shadow = ShadowDrafts(drafter, 2)
    policy = Recorder()
    shadow.step(scheduler, None, policy)
    assert drafter.asked == [[0, 1, 2, 3]]
    assert sorted(shadow.pending) == [0, 2, 3]
    assert policy.matching == [(4, 3)]
    seqs[2].status = SequenceStatus.FINISHED  # cut short: dropped, not scored
    for seq in seqs:
        decode(seq, 5)
        decode(seq, 6)
    shadow.step(scheduler, None, policy)
    assert policy.scored == [(2, 2), (2, 2)]  # 0 and 3, both drafts accepted
    assert drafter.asked[1] == [4, 5, 6, 7]  # the next ones in turn
