"""A draft checkpoint of its own (`{"method": "draft_model", "model": PATH}`) drafting on a
cache of its own: exact in mixed batches with preemption and through a KV handoff, seeded
requests reproducible (every family's checkpoint drafting for itself: `test_speculative.py`), beside a target on one rank and on a tensor-parallel group of rank
processes (n-gram drafts there too); a checkpoint that does not share the target's tokenizer
refused naming what differs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.workers.factories import hand_off
from tests.workers.test_speculative import PROMPTS, texts
from workers import LLM, SamplingParams
from workers.contract.protocol import WorkerRequest
from workers.engine.config import EngineConfig
from workers.engine.speculative.config import parse_speculative_config
from workers.models.make_model import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True)
MIXED = [GREEDY, SEEDED, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                        repetition_penalty=1.2, logprobs=2), GREEDY]
SMALL = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32)  # preempts


def draft_config(path: str, **extra: object) -> str:
    return json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                       "draft_length": "fixed", "disable_by_batch_size": 8, **extra})


@pytest.fixture(scope="module")
def small_draft(tiny_model, tmp_path_factory) -> str:
    """A smaller checkpoint of the tiny target's family and tokenizer: its first layer, final
    norm and head written as a model of one layer (random models agree on little else)."""
    out = tmp_path_factory.mktemp("draft")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(tiny_model) / name, out / name)
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    weights = load_file(Path(tiny_model) / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers." not in k or ".layers.0." in k},
              out / "model.safetensors")
    return str(out)


@pytest.fixture(scope="module")
def plain(tiny_model) -> list:
    return LLM(tiny_model, **SMALL).generate(PROMPTS, MIXED)


def test_a_smaller_draft_is_exact_in_mixed_batches_and_seeded_text_reproducible(
        tiny_model, small_draft, plain):
    llm = LLM(tiny_model, speculative_config=draft_config(small_draft), **SMALL)
    assert llm.engine.speculator.draft.caches[0].shape[0] == 2  # keys and values of 1 layer
    assert len(llm.engine.speculator.draft.caches) == 1
    got = llm.generate(PROMPTS, MIXED)
    greedy = [0, 2, 3]  # the seeded request's text is the speculation's own
    assert [texts(got)[i] for i in greedy] == [texts(plain)[i] for i in greedy]
    assert texts(llm.generate(PROMPTS, MIXED))[1] == texts(got)[1]
    assert 0 < llm.engine.stats().num_accepted_tokens < llm.engine.stats().num_draft_tokens


def test_a_handed_off_request_is_drafted_from_a_cache_filled_on_the_decode_worker(
        tiny_model, small_draft):
    prompt = PROMPTS[0] * 2
    want = LLM(tiny_model, num_blocks=64).generate([prompt], GREEDY)[0].outputs[0].token_ids
    decode = LLM(tiny_model, num_blocks=64, speculative_config=draft_config(small_draft)).engine
    prefill = LLM(tiny_model, num_blocks=64).engine
    assert hand_off(prefill, decode, WorkerRequest("x", tuple(prompt), GREEDY)) == want
    assert decode.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_a_tensor_parallel_target_speculates_with_drafts_made_beside_it(
        tiny_model, small_draft, plain, method):
    """The target on two rank processes (its logits come back to the driver, which verifies);
    a draft checkpoint drafts on the driver: greedy text the plain engine's, a seeded text the
    one-rank speculating engine's (draws come from (seed, position))."""
    config = (draft_config(small_draft) if method == "draft_model" else
              json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                          "prompt_lookup_min": 1, "draft_length": "fixed",
                          "disable_by_batch_size": 8}))
    one = LLM(tiny_model, speculative_config=config, **SMALL).generate(PROMPTS, MIXED)
    llm = LLM(tiny_model, speculative_config=config, tensor_parallel_size=2, **SMALL)
    try:
        got = llm.generate(PROMPTS, MIXED)
        stats = llm.engine.stats()
    finally:
        llm.engine.close()
    greedy = [0, 2, 3]
    assert [texts(got)[i] for i in greedy] == [texts(plain)[i] for i in greedy]
    assert texts(got)[1][0] == texts(one)[1][0]
    assert stats.num_accepted_tokens > 0


def test_a_draft_not_sharing_the_targets_tokenizer_is_refused_naming_it(
        tiny_model, small_draft, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small_draft, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's tokenizer: token '!' is "
                                         "id 0 in the target's, 1 in the draft's"):
        LLM(tiny_model, num_blocks=16, speculative_config=draft_config(str(other)))
    qwen = make_model(tmp_path / "qwen", arch="qwen2", preset="tiny")  # 512 ids too
    with pytest.raises(ValueError, match="token '<\\|begin_of_text\\|>' is id 504 in the "
                                         "target's, None in the draft's"):
        LLM(tiny_model, num_blocks=16, speculative_config=draft_config(str(qwen)))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 640}))
    with pytest.raises(ValueError, match="has 640 token ids, the target 512"):
        LLM(tiny_model, num_blocks=16, speculative_config=draft_config(str(other)))
    with pytest.raises(ValueError, match="cannot be read"):
        LLM(tiny_model, num_blocks=16, speculative_config=draft_config(str(tmp_path / "none")))
    with pytest.raises(ValueError, match="model names a draft checkpoint for method "
                                         r"'draft_model'.*method 'ngram'"):
        parse_speculative_config(json.dumps({"method": "ngram", "num_speculative_tokens": 2,
                                             "model": small_draft}))
    with pytest.raises(ValueError, match="'quantized_self' drafts with the target's weights, "
                                         "which a group of 2 ranks holds"):
        EngineConfig(model=tiny_model, tensor_parallel_size=2, speculative_config=json.dumps(
            {"method": "quantized_self", "num_speculative_tokens": 2}))
