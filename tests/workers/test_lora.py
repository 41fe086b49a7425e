"""LoRA adapters against PEFT itself: adapters made with `get_peft_model` + `save_pretrained` on
checkpoints transformers wrote, served by the engine alone and mixed in one batch with the base
model and each other; logprobs of 32 greedy tokens within 1e-4 (fp32) and the tokens identical
to PEFT recomputing the whole sequence each step (dense families, and an MoE's attention and
experts, which PEFT reaches by `target_parameters`: Qwen3-MoE's, Mixtral's, DeepSeek's; a mixed
prefill's logits too). Then the
adapters a user gets wrong, refused with what is wrong (gpt-oss's experts among them), and the
prefix cache kept apart per adapter. Under TP=2: `tests/workers/test_parallel_engine.py`."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

import torch

from tests.workers.hf_oracle import (ATTENTION, DENSE_ADAPTERS, EXPERTS, MLP,
                                     greedy_reference, peft_adapter, peft_family, save_hf_model)
from workers import LLM, SamplingParams
from workers.engine.parallel.messages import StepMessage
from workers.models.lora import LoraAdapterError

# PEFT is imported where a test uses it: at the top it cost every pytest-xdist worker 2.7 s
# of collection, the one running this file included
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="PEFT is the oracle (the test extras install it)")

STEPS = 32
TOL = 1e-4
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(20, 45))]
ADAPTERS = DENSE_ADAPTERS  # name -> (targets, rank, alpha, rsLoRA)
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def family(request, tmp_path_factory):
    """(checkpoint, adapter folders, references by (adapter or None, prompt)): four adapters,
    a dense family's on attention only, attention and MLP, MLP only, q and v (three ranks); an
    MoE's on its attention, and its experts (`MOE_ADAPTERS`), one its experts only (Mixtral's:
    under `block_sparse_moe` here, transformers 5's `mlp`), one k and v."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    moe = request.param in ("qwen3_moe", "mixtral")
    # four adapters each (the mixed batch: the base model, one adapter and three others)
    extra = ({"experts": ([], 4, 8, False, EXPERTS), "kv": (["k_proj", "v_proj"], 2, 4, False)}
             if moe else {"mlp": (MLP, 4, 4, False), "qv": (["q_proj", "v_proj"], 2, 4, False)})
    return peft_family(request.param, root, PROMPTS, STEPS, extra)


def serve(path, folders, **options):
    modules = tuple(f"{name}={folder}" for name, folder in folders.items())
    return LLM(path, block_size=4, num_blocks=256, enable_lora=True, max_lora_rank=8,
               lora_modules=modules, **options)


def assert_matches(outputs, loras, prompts, refs):
    for lora, prompt, out in zip(loras, prompts, outputs, strict=True):
        ref = refs[lora, tuple(prompt)]
        sample = out.outputs[0]
        assert sample.token_ids == ref.tokens, f"adapter {lora}, prompt {prompt[:4]}..."
        got = [lp.logprob for lp in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs, strict=True)) <= TOL, lora


def test_each_adapter_alone_and_all_mixed_in_one_batch_match_peft(family):
    path, folders, refs = family
    for name in folders:  # each adapter changes the output: the test can tell them apart
        assert any(refs[name, tuple(p)].tokens != refs[None, tuple(p)].tokens for p in PROMPTS)
    llm = serve(path, folders, max_loras=len(folders))
    for name in folders:
        assert_matches(llm.generate(PROMPTS, GREEDY, lora_name=name), [name] * len(PROMPTS),
                       PROMPTS, refs)
    # every prompt under the base model and each adapter, interleaved, in one batch
    loras = [lora for _ in PROMPTS for lora in (None, *folders)]
    prompts = [p for p in PROMPTS for _ in (None, *folders)]
    assert_matches(llm.generate(prompts, GREEDY, lora_name=loras), loras, prompts, refs)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_fewer_slots_than_adapters_evicts_and_stays_exact(family):
    """max_loras=1: a step runs one adapter (and the base model); the others wait, and each
    comes back into the slot from host memory."""
    path, folders, refs = family
    llm = serve(path, folders, max_loras=1)
    loras = [lora for _ in PROMPTS for lora in (*ADAPTERS, None)]
    prompts = [p for p in PROMPTS for _ in (*ADAPTERS, None)]
    assert_matches(llm.generate(prompts, GREEDY, lora_name=loras), loras, prompts, refs)
    assert llm.engine.adapters.slots.num_loads >= len(ADAPTERS)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_adapter_decode_steps_keep_the_fused_cpu_stack(family, monkeypatch):
    """The tiny Llama's decode steps run in the fused CPU decoder stack (one C call for every
    layer) with the LoRA products added inside it, adapter rows or not, and stay exact."""
    path, folders, refs = family
    llm = serve(path, folders, max_loras=2)
    stack = llm.engine.runner.executor.model.model.fused_stack
    assert stack is not None, "the fused stack is not built here: nothing to check"
    with_adapters: list[bool] = []
    fn = stack.fn

    def counted(*args):
        with_adapters.append(args[16] is not None)  # the step's adapter rows, or NULL
        return fn(*args)

    monkeypatch.setattr(stack, "fn", counted)
    loras = [lora for _ in PROMPTS for lora in (None, *ADAPTERS)]
    prompts = [p for p in PROMPTS for _ in (None, *ADAPTERS)]
    assert_matches(llm.generate(prompts, GREEDY, lora_name=loras), loras, prompts, refs)
    assert with_adapters.count(True) >= STEPS - 1  # every decode step of the mixed batch


@pytest.fixture(scope="module")
def llama_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-errors")
    base = save_hf_model("llama", root / "base")
    good = root / "good"
    peft_adapter(base, good, ATTENTION, 4, 8, False, seed=0)
    peft_adapter(base, root / "big", ATTENTION, 8, 16, False, seed=2)
    other = save_hf_model("llama", root / "other", hidden_size=32)
    peft_adapter(other, root / "other-base", ATTENTION, 4, 8, False, seed=1)
    llm = LLM(str(root / "base"), block_size=4, num_blocks=64, enable_lora=True,
              max_lora_rank=4, max_loras=2)
    return llm, root


def _broken(root, name, edit):
    folder = root / name
    if not folder.exists():
        shutil.copytree(root / "good", folder)
        edit(folder)
    return folder


@pytest.mark.parametrize("case, expected", [
    ("missing-folder", "no folder at"),
    ("missing-weights", "adapter_model.safetensors is missing"),
    ("missing-config", "adapter_config.json is missing"),
    ("unknown-target", "unknown target module(s) ['embed_tokens']"),
    ("rank-over-limit", "rank r=8 is over max_lora_rank=4"),
    ("other-base", "has shape [4, 32], the base model needs [4, 64]"),
])
def test_a_bad_adapter_is_refused_naming_what_is_wrong_and_nothing_is_kept(
        llama_lora, case, expected):
    llm, root = llama_lora

    def retarget(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        config["target_modules"] = ["q_proj", "embed_tokens"]
        (folder / "adapter_config.json").write_text(json.dumps(config))

    edits = {"missing-weights": lambda f: (f / "adapter_model.safetensors").unlink(),
             "missing-config": lambda f: (f / "adapter_config.json").unlink(),
             "unknown-target": retarget}
    folder = {"missing-folder": root / "nowhere",
              "rank-over-limit": root / "big",  # rank 8, the engine's limit 4
              "other-base": root / "other-base"}.get(case) or _broken(root, case, edits[case])
    adapters = llm.engine.adapters
    with pytest.raises(LoraAdapterError) as err:
        adapters.load(case, str(folder))
    assert expected in str(err.value) and repr(case) in str(err.value)
    assert case not in adapters.names()
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate([[1, 2, 3]], GREEDY, lora_name=case)


def test_load_serve_unload(llama_lora):
    llm, root = llama_lora
    adapters = llm.engine.adapters
    adapters.load("small", str(root / "good"))
    with pytest.raises(LoraAdapterError, match="already loaded"):
        adapters.load("small", str(root / "good"))
    assert "small" in adapters.names()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4),
                       lora_name="small")
    assert len(out[0].outputs[0].token_ids) == 4
    assert "small" in llm.engine.stats().lora_adapters  # in a slot: the router routes by it
    adapters.unload("small", [])
    assert "small" not in adapters.names() and "small" not in llm.engine.stats().lora_adapters
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate([[1, 2, 3]], GREEDY, lora_name="small")
    with pytest.raises(KeyError):
        adapters.unload("small", [])


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_prefix_cache_is_kept_apart_per_adapter(family):
    """The same prompt under two adapters and the base model: no block hits across them; a
    repeat under the same adapter hits; an adapter reloaded with other weights does not."""
    path, folders, refs = family
    llm = serve(path, folders, max_loras=2)
    prompt = list(range(20, 45))  # 6 full blocks of 4
    one = SamplingParams(temperature=0.0, max_tokens=1)
    firsts = [llm.generate([prompt], one, lora_name=lora)[0] for lora in ("attn", "full", None)]
    assert [o.num_cached_tokens for o in firsts] == [0, 0, 0]
    again = llm.generate([prompt], GREEDY, lora_name="attn")
    assert again[0].num_cached_tokens == 24
    assert_matches(again, ["attn"], [prompt], refs)  # the hit blocks are the adapter's KV
    # other weights loaded under the same name: the blocks cached under the old ones never hit
    llm.engine.adapters.unload("attn", [])
    llm.engine.adapters.load("attn", str(folders["full"]))
    reloaded = llm.generate([prompt], GREEDY, lora_name="attn")
    assert reloaded[0].num_cached_tokens == 0
    assert reloaded[0].outputs[0].token_ids == refs["full", tuple(prompt)].tokens


def mixed_prefill(prompts, slots, writes):
    """One step prefilling each of `prompts` (its own blocks of 4) under its adapter slot (-1:
    the base model), every row's logits wanted."""
    starts, blocks, first = [0], [], 0
    for p in prompts:
        starts.append(starts[-1] + len(p))
        count = -(-len(p) // 4)
        blocks.append(tuple(range(first, first + count)))
        first += count
    slot_mapping = [b[i // 4] * 4 + i % 4 for p, b in zip(prompts, blocks) for i in range(len(p))]
    return StepMessage(step_id=0, input_ids=tuple(t for p in prompts for t in p),
                       positions=tuple(i for p in prompts for i in range(len(p))),
                       slot_mapping=tuple(slot_mapping), query_start_loc=tuple(starts),
                       seq_lens=tuple(len(p) for p in prompts), block_tables=tuple(blocks),
                       num_decodes=0, logit_rows=tuple(range(starts[-1])),
                       lora_slots=tuple(slots), lora_writes=tuple(writes))


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_lora_on_an_moe_s_experts_prefill_logits_match_peft_in_a_mixed_step(family):
    """PEFT's `target_parameters` LoRA on the experts (gate_up_proj and down_proj, PEFT's
    interleaved per-expert rank blocks): one prefill step of the base model, the experts-only
    adapter and the attention + experts one gives each sequence PEFT's logits within 1e-4, and
    each adapter's expert products are what moves them (the base model's are far off)."""
    import peft
    import transformers

    path, folders, _ = family
    llm = serve(path, folders, max_loras=2)
    prompts = [PROMPTS[1][:13], PROMPTS[0], PROMPTS[1][5:]]
    loras = [None, "experts", "qvo"]
    msg = mixed_prefill(prompts, (-1, 0, 1), ((0, "experts"), (1, "qvo")))
    logits = llm.engine.runner.executor.execute(msg)
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    first = 0
    for prompt, lora in zip(prompts, loras, strict=True):
        model = base if lora is None else peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(path), folders[lora]).eval()
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].float()
            plain = base(torch.tensor([prompt])).logits[0].float()
        got = logits[first:first + len(prompt)]
        first += len(prompt)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL, msg=f"adapter {lora}")
        if lora is not None:
            assert (want - plain).abs().max() > 100 * TOL  # the adapter moves the logits


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_an_expert_target_this_model_lacks_is_refused_naming_it(family, tmp_path):
    path, folders, _ = family
    broken = tmp_path / "broken"
    shutil.copytree(folders["experts"], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.w1"]
    (broken / "adapter_config.json").write_text(json.dumps(config))
    llm = serve(path, {"attn": folders["attn"]}, max_loras=1)
    with pytest.raises(LoraAdapterError, match=r"target_parameters \['mlp.experts.w1'\] match no"):
        llm.engine.adapters.load("broken", str(broken))
    assert llm.engine.adapters.names() == ["attn"]


def test_lora_on_gpt_oss_s_experts_is_refused_naming_the_layout(tmp_path):
    """gpt-oss's experts (biased, clamped SwiGLU, [E, in, out] in transformers): PEFT's
    `target_parameters` on them are refused by name, nothing kept; its attention takes LoRA."""
    base = save_hf_model("gpt_oss", tmp_path / "base")
    peft_adapter(base, tmp_path / "experts", ["q_proj"], 4, 8, False, seed=0,
                 parameters=EXPERTS)
    peft_adapter(base, tmp_path / "attn", ["q_proj"], 4, 8, False, seed=1)
    llm = serve(str(tmp_path / "base"), {"attn": tmp_path / "attn"}, max_loras=1)
    with pytest.raises(LoraAdapterError, match=r"GptOssForCausalLM's experts \(biased, "
                       r"clamped SwiGLU"):
        llm.engine.adapters.load("experts", str(tmp_path / "experts"))
    assert llm.engine.adapters.names() == ["attn"]


def test_lora_on_deepseek_s_experts_alone_and_mixed_with_the_base_matches_peft(tmp_path):
    """DeepSeek's experts (its own grouped routing, a shared expert beside them; MLA, which
    PEFT's attention names do not reach): an experts-only adapter, each prompt under it and
    the base model in one batch, gives PEFT's 32 greedy tokens, logprobs within 1e-4."""
    base = save_hf_model("deepseek_v3", tmp_path / "base")
    model = peft_adapter(base, tmp_path / "experts", [], 4, 8, False, seed=0,
                         parameters=EXPERTS)
    refs = {(lora, tuple(p)): greedy_reference(m, p, STEPS) for p in PROMPTS
            for lora, m in ((None, base), ("experts", model))}
    assert all(refs["experts", tuple(p)].tokens != refs[None, tuple(p)].tokens for p in PROMPTS)
    llm = serve(str(tmp_path / "base"), {"experts": tmp_path / "experts"}, max_loras=1)
    loras = [lora for _ in PROMPTS for lora in (None, "experts")]
    prompts = [p for p in PROMPTS for _ in (None, "experts")]
    assert_matches(llm.generate(prompts, GREEDY, lora_name=loras), loras, prompts, refs)


@pytest.mark.parametrize("options, expected", [
    ({"pipeline_parallel_size": 2}, "one pipeline stage"),
    ({"pipeline_microbatches": 2}, "one micro-batch"),
])
def test_lora_with_a_split_step_is_refused_at_start(options, expected):
    """Tensor parallelism shards adapters; pipeline stages and micro-batches are refused."""
    from workers.engine.config import EngineConfig

    with pytest.raises(ValueError, match=expected):
        EngineConfig(model="unused", enable_lora=True, **options)
