"""TP, PP, TP x PP and EP engines against the single-process engine and transformers.

Each layout runs in real rank processes (gloo, one torch thread each) on checkpoints written by
transformers' `save_pretrained`: the logits of a prefill equal the single-process run and
transformers' within fp32 tolerance, and 32 greedy tokens are identical. LoRA adapters under
TP=2 likewise against PEFT.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.workers.hf_oracle import (EXPERTS, MLP, greedy_reference, peft_family,
                                     save_hf_model)
from workers import LLM, SamplingParams
from workers.engine.parallel.messages import StepMessage
from workers.models.lora import LoraAdapterError

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


# LoRA under TP=2: PEFT adapters (made by `get_peft_model` + `save_pretrained`) sharded as their
# projections, on the dense family and an MoE's attention and experts (`MOE_ADAPTERS`); a third
# adapter each (MLP only on the dense family, two attention projections and the experts on the
# MoE) so a batch mixes the base and three
LORA_PROMPTS = PROMPTS[:2]
THIRD_ADAPTER = {"llama": {"mlp": (MLP, 2, 4, False)},
                 "qwen3_moe": {"ko": (["k_proj", "o_proj"], 2, 4, False, EXPERTS)}}


@pytest.fixture(scope="module")
def lora_family(request, tmp_path_factory):
    """(checkpoint, adapter folders, greedy references, the second adapter's PEFT logits of a
    prefill of PROMPTS[2])."""
    peft = pytest.importorskip("peft", reason="PEFT is the oracle (the test extras install it)")
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"tp-lora-{request.param}")
    path, folders, refs = peft_family(request.param, root, LORA_PROMPTS, STEPS,
                                      THIRD_ADAPTER[request.param])
    last = list(folders)[1]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path),
                                           folders[last]).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[2]])).logits[0].float()
    return path, folders, refs, logits


@pytest.mark.parametrize("lora_family", ["llama", "qwen3_moe"], indirect=True)
def test_lora_adapters_sharded_over_tp2_match_peft(lora_family):
    """One adapter from the start, two loaded at run time (every rank reads its shard): the
    prefill logits equal PEFT's, each adapter alone and all three with the base model in one
    batch give PEFT's 32 greedy tokens; a bad adapter is refused with the group serving on, and an
    unload reaches every rank (the name loads again)."""
    path, folders, refs, peft_logits = lora_family
    first, last, third = list(folders)
    llm = LLM(path, block_size=BLOCK, num_blocks=128, tensor_parallel_size=2, enable_lora=True,
              max_lora_rank=8, max_loras=3, lora_modules=(f"{first}={folders[first]}",))
    adapters = llm.engine.adapters
    try:
        adapters.load(last, str(folders[last]))
        adapters.load(third, str(folders[third]))
        # the prefill alone, the adapter copied into slot 1 on every rank by the step itself
        msg = dataclasses.replace(prefill_message(PROMPTS[2]), lora_slots=(1,),
                                  lora_writes=((1, last),))
        logits = llm.engine.runner.executor.execute(msg)
        torch.testing.assert_close(logits, peft_logits, rtol=0, atol=TOL)
        for name in folders:
            assert_lora_matches(llm.generate(LORA_PROMPTS, GREEDY, lora_name=name),
                                [name] * len(LORA_PROMPTS), refs)
        loras = [lora for _ in LORA_PROMPTS for lora in (None, first, last, third)]
        prompts = [p for p in LORA_PROMPTS for _ in (None, first, last, third)]
        assert_lora_matches(llm.generate(prompts, GREEDY, lora_name=loras), loras, refs,
                            prompts)
        with pytest.raises(LoraAdapterError, match="no folder at"):
            adapters.load("missing", str(folders[last]) + "-nowhere")
        adapters.unload(last, [])
        with pytest.raises(ValueError, match="does not exist"):
            llm.generate([PROMPTS[0]], GREEDY, lora_name=last)
        adapters.load(last, str(folders[last]))  # the ranks forgot it: the name is free again
        assert adapters.names() == sorted(folders)
        again = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=4),
                             lora_name=last)
        assert again[0].outputs[0].token_ids == refs[last, tuple(PROMPTS[1])].tokens[:4]
    finally:
        llm.engine.close()


def assert_lora_matches(outputs, loras, refs, prompts=LORA_PROMPTS):
    for lora, prompt, out in zip(loras, prompts, outputs, strict=True):
        ref, sample = refs[lora, tuple(prompt)], out.outputs[0]
        assert sample.token_ids == ref.tokens, f"adapter {lora}, prompt {prompt[:4]}..."
        got = [lp.logprob for lp in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs, strict=True)) <= TOL, lora
