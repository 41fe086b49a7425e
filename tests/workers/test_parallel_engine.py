"""TP, PP, TP x PP and EP engines against the single-process engine and transformers.

Each layout runs in real rank processes (gloo, one torch thread each) on checkpoints written by
transformers' `save_pretrained`: the logits of a prefill equal the single-process run and
transformers' within fp32 tolerance, and 32 greedy tokens are identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.hf_oracle import greedy_reference, save_hf_model
from workers import LLM, SamplingParams
from workers.engine.parallel.messages import StepMessage

STEPS = 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(20, 45))]
BLOCK = 4
TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, path)
    with torch.no_grad():
        hf_logits = model(torch.tensor([PROMPTS[2]])).logits[0].float()
    refs = [greedy_reference(model, p, STEPS) for p in PROMPTS]
    single = LLM(str(path), block_size=BLOCK, num_blocks=64)
    single_logits = single.engine.runner.executor.execute(prefill_message(PROMPTS[2]))
    single_tokens = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    return request.param, str(path), hf_logits, refs, single_logits, single_tokens


def prefill_message(prompt: list[int]) -> StepMessage:
    """One prefill of `prompt` into blocks 0.. (no request owns them yet), all rows' logits."""
    n = len(prompt)
    blocks = tuple(range(-(-n // BLOCK)))
    return StepMessage(step_id=0, input_ids=tuple(prompt), positions=tuple(range(n)),
                       slot_mapping=tuple(range(n)), query_start_loc=(0, n), seq_lens=(n,),
                       block_tables=(blocks,), num_decodes=0, logit_rows=tuple(range(n)))


# One layout per distinct split a family adds: llama (the plain family) runs TP, PP and TP x PP
# alone; an MoE family runs TP (its experts sharded across the TP ranks) and TP x PP x EP (whole
# experts per EP rank, stages split); gemma3 and phi3 run TP x PP, which shards their weights and
# splits their stages in one run (TP alone and PP alone are llama's, family-independent)
LAYOUTS = {  # (tensor, pipeline, expert) parallel sizes
    "llama": [(2, 1, 1), (1, 2, 1), (2, 2, 1)],
    "mixtral": [(2, 1, 1), (2, 2, 2)],
    # q/k norm replicated on every TP rank, experts split across EP ranks
    "qwen3_moe": [(2, 1, 1), (2, 2, 2)],
    # local and global layers, the embedding's scale on the first stage only
    "gemma3": [(2, 2, 1)],
    # sinks split with the heads; expert biases (the output one added on one TP rank only)
    "gpt_oss": [(2, 1, 1), (2, 2, 2)],
    # heads split, the latent cache whole on every rank; grouped routing over EP ranks
    "deepseek_v3": [(2, 1, 1), (2, 2, 2)],
    # the fused qkv and gate_up tensors split into the parts each rank shards
    "phi3": [(2, 2, 1)],
}
CASES = [(arch, layout) for arch, layouts in LAYOUTS.items() for layout in layouts]


@pytest.mark.parametrize(("checkpoint", "layout"), CASES, indirect=["checkpoint"],
                         ids=[f"{arch}-tp{t}pp{p}ep{e}" for arch, (t, p, e) in CASES])
def test_parallel_layout_matches_single_process_and_transformers(checkpoint, layout):
    _, path, hf_logits, refs, single_logits, single_tokens = checkpoint
    tp, pp, ep = layout
    llm = LLM(path, block_size=BLOCK, num_blocks=64, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, expert_parallel_size=ep)
    try:
        logits = llm.engine.runner.executor.execute(prefill_message(PROMPTS[2]))
        torch.testing.assert_close(logits, single_logits, rtol=0, atol=TOL)
        torch.testing.assert_close(logits, hf_logits, rtol=0, atol=TOL)
        outputs = llm.generate(PROMPTS, GREEDY)
        for out, ref, single in zip(outputs, refs, single_tokens):
            sample = out.outputs[0]
            assert sample.token_ids == ref.tokens == single
            got = [lp.logprob for lp in sample.logprobs]
            assert max(abs(a - b) for a, b in zip(got, ref.logprobs)) <= TOL
        if pp > 1:  # the decode batch of three sequences ran as pp micro-batches
            busy = llm.engine.runner.executor.last_timings[0].microbatch_busy_s
            assert len(busy) == pp
    finally:
        llm.engine.close()
    assert llm.engine.runner.executor.group.closed
