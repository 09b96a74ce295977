"""engine/plan.py on hand-built scheduled sequences: which steps are greedy-only (the decode
stack's greedy tail may answer them whole), and a decode step's padded layout."""

from __future__ import annotations

import torch

from tailguard.core.request import EngineRequest, RequestKind, SamplingParams
from tailguard.core.scheduler import ScheduledSeq
from tailguard.core.sequence import Sequence
from tailguard.engine.config import EngineConfig
from tailguard.engine.plan import StepPlan, greedy_only
from tailguard.model.batch import NULL_BLOCK


def _decode(rid: str, prompt: int = 5, **kw: object) -> ScheduledSeq:
    """A sequence of `prompt` tokens whose last token runs this step (a decode)."""
    sampling = SamplingParams(max_tokens=8, **kw)  # type: ignore[arg-type]
    req = EngineRequest(
        request_id=rid, prompt_token_ids=tuple(range(3, 3 + prompt)), sampling=sampling
    )
    seq = Sequence.from_request(req, order=0)
    seq.block_table = [7, 9]
    return ScheduledSeq(seq=seq, start=prompt - 1, num_new=1)


def test_greedy_only_takes_steps_whose_every_sequence_wants_just_its_argmax() -> None:
    greedy = [_decode("a"), _decode("b")]
    assert greedy_only(greedy)
    assert not greedy_only([*greedy, _decode("hot", temperature=0.7)])  # sampled: logits
    chunk = _decode("c", prompt=9)
    partial = ScheduledSeq(seq=chunk.seq, start=0, num_new=4)  # a prefill chunk, no output
    assert not greedy_only([*greedy, partial])
    one_pass = _decode("d")
    one_pass.seq.request = EngineRequest(
        request_id="d", prompt_token_ids=(3, 4), sampling=SamplingParams(max_tokens=0)
    )
    assert not greedy_only([one_pass])  # max_tokens 0: a single pass (scores)
    scored = _decode("e")
    scored.seq.request = EngineRequest(
        request_id="e", prompt_token_ids=(3, 4), kind=RequestKind.SCORE, top_k=2
    )
    assert not greedy_only([scored])


def test_a_decode_step_is_padded_to_its_buckets() -> None:
    """Three decodes: the token and sequence dims pad to their buckets, each sequence's last
    index is its own row, padding rows point at the last padded token and read the null
    block, and the shape key names the group's (G, Q, B) buckets and the head's rows."""
    config = EngineConfig(
        model_dir="unused",
        seq_buckets=(1, 4, 8),
        token_buckets=(1, 4, 8),
        max_num_seqs=8,
        max_num_batched_tokens=8,
    )
    items = [_decode("a", prompt=5), _decode("b", prompt=17), _decode("c", prompt=2)]
    plan = StepPlan.build(items, config, (2, 4), torch.device("cpu"))
    assert plan.shape == (4, 4)
    assert plan.last_index.tolist() == [0, 1, 2, 3]
    assert plan.batch.input_ids.tolist()[:3] == [7, 19, 4]  # each sequence's last token
    assert plan.batch.positions.tolist()[:3] == [4, 16, 1]
    (group,) = plan.batch.groups
    assert group.token_index.shape[1] == 1 and group.block_tables.shape[1] == 2
    assert group.block_tables[3].tolist() == [NULL_BLOCK, NULL_BLOCK]  # the padding row
    assert plan.needs_logits and plan.spans == [(0, 1), (1, 2), (2, 3)]
    assert len(plan.keys) >= 2  # the step's tokens, the group, the head's rows
