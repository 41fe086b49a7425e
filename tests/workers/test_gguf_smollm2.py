"""A real, trained model served from its GGUF file as shipped (SmolLM2-135M-Instruct, Q4_1),
against transformers' GGUF loading of the same file: logits on a real prompt within fp32 1e-4,
32 greedy tokens identical, the same tokenizer ids, and a chat answer that knows the capital of
France."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from tests.workers.gguf_files import EDGE_TEXTS, assert_same_tokenizer, cleave_logits
from tests.workers.smollm2 import smollm2_gguf, smollm2_reference_folder
from workers import LLM, SamplingParams
from workers.models.model_config import ModelConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TOL = 1e-4
STEPS = 32
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# real text: a few topics of the Python reference manual every CPython installation carries
REAL_TEXT = [pydoc_data.topics.topics[key][:1500] for key in ("assert", "for", "lambda")]


@pytest.fixture(scope="module")
def path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_reference_folder()), dtype=torch.float32).eval()


def test_the_file_reads_as_smollm2(path):
    config = ModelConfig.from_pretrained(path)
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == (
        "LlamaForCausalLM", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (
        9, 3, 49152)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)


def test_logits_on_a_real_prompt_match_transformers(path, llm, reference):
    prompt = llm.tokenizer.encode(REAL_TEXT[1][:400])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    diff = (cleave_logits(path, prompt) - expected).abs().max().item()
    print(f"SmolLM2 Q4_1: {len(prompt)} tokens, max |logit diff| {diff:.2e}")
    assert expected.std() > 1.0 and diff <= TOL


def test_greedy_tokens_match_transformers(llm, reference):
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template(QUESTION, tokenize=True)]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        tokens, logprobs = cached_greedy(reference, prompt, STEPS)
        sample = out.outputs[0]
        assert sample.token_ids == tokens
        diff = max(abs(lp.logprob - r) for lp, r in zip(sample.logprobs, logprobs))
        print(f"SmolLM2 greedy: max |logprob diff| {diff:.2e}")
        assert diff <= TOL


@torch.no_grad()
def cached_greedy(model: torch.nn.Module, prompt: list[int], steps: int
                  ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probabilities, decoding on its KV cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(steps):
        last = out.logits[0, -1].float().log_softmax(-1)
        tokens.append(int(last.argmax()))
        logprobs.append(last[tokens[-1]].item())
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens, logprobs


def test_a_chat_answer_names_paris(llm):
    tokenizer = llm.tokenizer
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=True)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in tokenizer.decode(out.token_ids)
    assert out.token_ids[-1] == tokenizer.eos_token_id  # the turn ends with <|im_end|>


@torch.no_grad()
def test_embeddings_are_transformers_pooled_hidden_states(llm, reference):
    from workers.serving.embed import embed

    prompts = [llm.tokenizer.encode(text[:300]) for text in REAL_TEXT]
    for pooling in ("last", "mean"):
        got = embed(llm.engine, prompts, pooling, normalize=False)
        for vector, prompt in zip(got.vectors, prompts):
            hidden = reference.model(torch.tensor([prompt])).last_hidden_state[0]
            want = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            diff = (torch.tensor(vector) - want).abs().max().item()
            print(f"SmolLM2 {pooling} embedding: max |diff| {diff:.2e}, "
                  f"max |value| {want.abs().max().item():.1f}")
            assert diff <= TOL, (pooling, diff)


def test_tokenizer_ids_match_transformers(path):
    assert_same_tokenizer(path, EDGE_TEXTS + REAL_TEXT, saved=smollm2_reference_folder())
