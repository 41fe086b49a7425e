"""Decode graphs on a worker group's ranks, the parts a CPU can run.

The driver picks each pure decode's padded size (`graph_ladder.padded_size`) and sends it to
every rank; CPU gloo ranks then run the graphs' static buffers eagerly (nothing is captured on
a CPU), so the padding, the sink block that takes the padded rows' K/V and the driver's choice
are checked here: a padded group gives the tokens of an eager one and of one process. The
capture itself (NCCL collectives inside CUDA graphs): tests/gpu/test_parallel_graphs_nccl.py.
"""

from __future__ import annotations

import pytest

from workers import LLM, SamplingParams
from workers.engine import assembly
from workers.engine.parallel.graph_ladder import capture_sizes, padded_size
from workers.engine.parallel.messages import StepMessage

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(20, 45))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
COMMON = {"device": "cpu", "dtype": "float32", "num_blocks": 64, "block_size": 4}


def decode(n: int, seq_len: int = 5, blocks: int = 2) -> StepMessage:
    return StepMessage(1, (1,) * n, (seq_len - 1,) * n, (0,) * n, tuple(range(n + 1)),
                       (seq_len,) * n, (tuple(range(blocks)),) * n, n, tuple(range(n)))


def test_a_pure_decode_pads_to_the_next_captured_size_and_anything_else_runs_eagerly():
    sizes = capture_sizes(12)
    assert sizes == [1, 2, 4, 8, 12]
    assert [padded_size(decode(n), sizes, 64, 16) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12,
                                                                                 12]
    assert padded_size(decode(13), sizes, 64, 16) is None  # more than the largest graph
    assert padded_size(decode(3, seq_len=65), sizes, 64, 16) is None  # past max_seq_len
    assert padded_size(decode(3, blocks=17), sizes, 64, 16) is None  # wider than the buffer
    assert padded_size(decode(3), [], 64, 16) is None  # nothing captured
    prefill = StepMessage(1, (1, 2, 3), (0, 1, 2), (0, 1, 2), (0, 3), (3,), ((0,),), 0, (2,))
    assert padded_size(prefill, sizes, 64, 16) is None


def generate(monkeypatch: pytest.MonkeyPatch, graph_batch_size: int,
             **config: object) -> tuple[list[list[int]], list[int], tuple[int, ...]]:
    """Greedy tokens of a TP=2 CPU group whose ranks serve decodes of up to
    `graph_batch_size` sequences from static buffers (0: eager), the graph size of each step
    the driver sent, and the sizes the ranks serve."""
    monkeypatch.setattr(assembly, "group_graph_batch_size", lambda cfg, kind: graph_batch_size)
    llm = LLM(tensor_parallel_size=2, **COMMON, **config)
    executor = llm.engine.runner.executor
    sent: list[int] = []
    padded = executor.padded

    def record(msg: StepMessage) -> StepMessage:
        out = padded(msg)
        sent.append(out.graph_size)
        return out

    executor.padded = record
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()
    return tokens, sent, executor.graph_sizes


def test_padded_decodes_on_gloo_ranks_give_the_eager_groups_and_one_process_tokens(
        monkeypatch, tiny_model):
    single = LLM(tiny_model, **COMMON)
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    eager, eager_sent, eager_sizes = generate(monkeypatch, 0, model=tiny_model)
    padded, sent, sizes = generate(monkeypatch, 4, model=tiny_model)
    assert eager_sizes == () and set(eager_sent) == {0}
    assert sizes == (1, 2, 4)  # served from static buffers, eagerly: nothing is captured
    # three sequences decode padded to 4 rows; their padded row's K/V went to the sink block,
    # not into a block of theirs (that would change the next tokens)
    assert sent.count(4) >= GREEDY.max_tokens - 2 and 0 in sent  # prefills stay eager
    assert padded == eager == want
