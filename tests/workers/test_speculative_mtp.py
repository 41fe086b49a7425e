"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer as the draft: greedy
output identical to decoding without speculation (mixed batches, chunked prefill, preemption),
the drafted tokens the MTP head's argmax over the target's hidden states, near-full acceptance
where the MTP layer is made to predict the target's next choice (and none with its inputs
wired wrong), sampled tokens from the target's distribution, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.test_rejection_sampling import (SAMPLES, first_tokens, pooled_p_value,
                                                   target_joint)
from workers import LLM, SamplingParams
from workers.engine.parallel.messages import StepMessage
from workers.engine.parallel.pipeline import MicroBatch, microbatch_tensors
from workers.engine.runner import allocate_kv_caches
from workers.engine.speculative.mtp import MTPDraft
from workers.contract.protocol import WorkerRequest
from tests.workers.factories import hand_off

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "draft_length": "fixed",
                  "disable_by_batch_size": 8})
PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(10, 60)), [40, 41, 42, 40, 41, 42, 40, 41],
           [3, 4] * 9]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    """Tiny DeepSeek-V3 (2 layers, the second MoE) with a random MTP layer (MoE too)."""
    from workers.models.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("dsv3-mtp"), arch="deepseek_v3",
                          overrides={"num_nextn_predict_layers": 1}))


def predicting_mtp(out: Path, swap: bool = False, head_scale: float = 1.0) -> str:
    """A one-layer DeepSeek-V3 whose next token depends on the current token only (attention's
    output projection zeroed, embeddings of unit RMS) and whose MTP layer is that layer again,
    reading only the embedding of token i + 1 (eh_proj = [I | 0]): it drafts exactly the
    target's next choice. `swap`: eh_proj reads the hidden state instead (a wiring with the
    two inputs exchanged); `head_scale`: its head's logits scaled (another distribution)."""
    from workers.models.make_model import make_model

    make_model(out, arch="deepseek_v3", overrides={
        "num_hidden_layers": 1, "num_nextn_predict_layers": 1, "first_k_dense_replace": 2})
    weights = load_file(out / "model.safetensors")
    emb = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    for name in [n for n in weights if n.startswith("model.layers.0.")]:
        weights[name.replace("layers.0.", "layers.1.")] = weights[name].clone()
    for i in (0, 1):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
    h = emb.shape[1]
    eye, zero = torch.eye(h), torch.zeros(h, h)
    weights["model.layers.1.eh_proj.weight"] = torch.cat([zero, eye] if swap else [eye, zero], 1)
    weights["model.layers.1.shared_head.head.weight"] = weights["lm_head.weight"] * head_scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def outputs(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_greedy_is_identical_in_mixed_batches_with_chunked_prefill_and_preemption(mtp_model):
    # 24 blocks of 4: preemptions; 32-token steps: the 50-token prompt prefilled in chunks
    # beside the others' verifications; request 1 does not speculate
    options = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32)
    base, spec = LLM(mtp_model, **options), LLM(mtp_model, speculative_config=MTP, **options)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             speculative=i != 1) for i in range(len(PROMPTS))]
    assert outputs(spec, params) == outputs(base, params)
    stats = spec.engine.stats()
    assert stats.speculative_method == "mtp" and stats.num_draft_tokens > 0
    assert base.engine.runner.executor.model.mtp is None  # loaded only where it drafts
    assert spec.engine.scheduler.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks


def reference_drafter(llm: LLM):
    """draft(tokens, k): the MTP head's greedy draft of k tokens after `tokens` (the last not
    yet computed), from scratch: the target over tokens[:-1] in one forward on a cache of its
    own gives h[i]; the MTP layer over positions 0..n-2 with tokens[1:] on another, then on
    its own output (each run writes every position it reads before reading it)."""
    engine = llm.engine
    model, spec = engine.speculator.draft.model, engine.runner.spec
    size, device = spec.block_size, engine.device
    caches = allocate_kv_caches(spec, device)
    fresh = MTPDraft(model, allocate_kv_caches(spec, device)[0], device, size,
                     torch.Generator(), "mtp")

    def draft(tokens: list[int], k: int) -> list[int]:
        n = len(tokens)
        table = tuple(range(-(-(n + k) // size)))
        msg = StepMessage(step_id=0, input_ids=tuple(tokens[:-1]),
                          positions=tuple(range(n - 1)), slot_mapping=tuple(range(n - 1)),
                          query_start_loc=(0, n - 1), seq_lens=(n - 1,), block_tables=(table,),
                          num_decodes=int(n == 2), logit_rows=())
        ids, pos, meta = microbatch_tensors(msg, MicroBatch(0, 1, 0, n - 1), device)
        model(ids, pos, caches, meta)
        chunk = (tokens[1:], list(range(n - 1)), model.model.prenorm)
        drafted: list[int] = []
        for j in range(k):
            hidden, (last,) = fresh._run([chunk], [table])
            drafted.append(int(fresh.mtp.compute_logits(hidden[last:last + 1]).argmax()))
            chunk = ([drafted[-1]], [n - 1 + j], hidden[last:last + 1])
        return drafted

    return draft


def test_drafts_are_the_mtp_heads_argmax_over_the_targets_hidden_states(mtp_model, monkeypatch):
    """Every draft the engine makes (chunked prompts, verifications with rejections, steps the
    acceptance back-off pauses) is the one the MTP layer makes from scratch over the target's
    hidden states of the same tokens."""
    spec = LLM(mtp_model, num_blocks=64, max_num_batched_tokens=16, speculative_config=json.dumps(
        {**json.loads(MTP), "num_speculative_tokens": 2}))
    draft = spec.engine.speculator.draft
    seen: list[tuple[list[int], list[int]]] = []
    propose = draft.propose

    def spy(reqs, ks, tables):
        drafts = propose(reqs, ks, tables)
        seen.extend((list(r.all_token_ids), d.tokens) for r, d in zip(reqs, drafts) if d.tokens)
        return drafts

    monkeypatch.setattr(draft, "propose", spy)
    spec.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert len(seen) > 12
    reference = reference_drafter(spec)
    assert all(reference(tokens, len(d)) == d for tokens, d in seen)


def test_an_mtp_layer_that_predicts_the_target_has_its_drafts_accepted(tmp_path):
    good = LLM(predicting_mtp(tmp_path / "good"), num_blocks=64, speculative_config=MTP)
    base = LLM(str(tmp_path / "good"), num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert outputs(good, params) == outputs(base, params)
    stats = good.engine.stats()
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens > 0
    # the same layer with its two inputs exchanged: exact still, its drafts rejected
    swapped = LLM(predicting_mtp(tmp_path / "swapped", swap=True), num_blocks=64,
                  speculative_config=MTP)
    assert outputs(swapped, params) == outputs(base, params)
    stats = swapped.engine.stats()
    assert stats.num_accepted_tokens < 0.2 * stats.num_draft_tokens


def test_sampled_mtp_drafts_leave_the_targets_distribution(tmp_path, monkeypatch):
    """The rejection sampling of `test_rejection_sampling`, with an MTP draft whose
    distribution differs from the target's (its head's logits halved): the first 3 tokens of
    400 seeded requests follow the target's, and the same test fails on a wrong rule."""
    import workers.engine.sampler as sampler

    path = predicting_mtp(tmp_path / "m", head_scale=0.5)
    joint = target_joint(LLM(path, num_blocks=64), depth=3)
    config = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2,
                         "draft_length": "fixed", "disable_by_batch_size": SAMPLES})
    spec = LLM(path, num_blocks=4 * SAMPLES, max_num_seqs=SAMPLES,
               max_num_batched_tokens=16 * SAMPLES, speculative_config=config)
    assert pooled_p_value(first_tokens(spec, 3), joint) > 1e-3
    stats = spec.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    rule = sampler.rejection_sample  # a wrong rule: every drafted token accepted
    monkeypatch.setattr(sampler, "rejection_sample",
                        lambda d, q, p, g: rule(d, torch.zeros_like(q), p, g))
    assert pooled_p_value(first_tokens(spec, 3), joint) < 1e-6


def test_a_checkpoint_without_an_mtp_layer_and_a_decode_worker_are_refused(tiny_model,
                                                                           mtp_model):
    from workers.serving.roles import check_role_fits_engine

    with pytest.raises(ValueError, match=r"method 'mtp'.*num_nextn_predict_layers=0"):
        LLM(tiny_model, num_blocks=16, speculative_config=MTP)
    llm = LLM(mtp_model, num_blocks=16, speculative_config=MTP)
    with pytest.raises(ValueError, match=r"role 'decode'.*hidden states of the prompt"):
        check_role_fits_engine("decode", llm.engine)
    check_role_fits_engine("prefill", llm.engine)


def test_a_request_handed_off_to_an_mtp_engine_decodes_as_without_speculation(mtp_model):
    """The prompt's hidden states stay with the prefill engine: the MTP layer drafts from the
    positions decoded here (its cache holds nothing for the prompt): the same output."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompt = PROMPTS[0] * 2
    want = LLM(mtp_model, num_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    prefill = LLM(mtp_model, num_blocks=64).engine
    decode = LLM(mtp_model, num_blocks=64, speculative_config=MTP).engine
    assert hand_off(prefill, decode, WorkerRequest("x", tuple(prompt), params)) == want
    assert decode.stats().num_draft_tokens > 0
