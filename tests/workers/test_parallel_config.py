"""Parallel layouts that cannot work are refused up front, in the user's terms."""

from __future__ import annotations

import dataclasses

import pytest

from workers.engine.config import EngineConfig
from workers.models.model_config import ModelConfig, MoEConfig
from workers.engine.parallel.messages import StepMessage
from workers.engine.parallel.pipeline import (
    MicroBatch,
    ideal_bubble_fraction,
    split_microbatches,
    stage_layers,
)
from workers.engine.parallel.validate import check_parallel

RAW = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2}
LLAMA = ModelConfig.from_dict(RAW)
MIXTRAL = dataclasses.replace(LLAMA, moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64,
                                                    norm_topk_prob=True))


def config(device: str = "cpu", **sizes: int) -> EngineConfig:
    return EngineConfig(model="unused", device=device, **sizes)


@pytest.mark.parametrize("sizes, model, devices, message", [
    ({"tensor_parallel_size": 3}, LLAMA, None,
     "tensor_parallel_size=3 does not divide the model's num_attention_heads=4"),
    ({"tensor_parallel_size": 4}, LLAMA, None,
     "tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"),
    ({"pipeline_parallel_size": 3}, LLAMA, None,
     "pipeline_parallel_size=3 is more than the model's num_hidden_layers=2"),
    ({"tensor_parallel_size": 2, "expert_parallel_size": 2}, LLAMA, None,
     "expert_parallel_size=2 needs a mixture-of-experts model"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, LLAMA, 2,
     "needs 4 devices; only 2 are visible"),
])
def test_layouts_the_model_or_machine_cannot_hold_are_refused(sizes, model, devices, message):
    with pytest.raises(ValueError, match=message):
        check_parallel(config(**sizes), model, devices)


def test_expert_parallel_size_must_divide_the_experts():
    six = dataclasses.replace(MIXTRAL, num_attention_heads=6, num_key_value_heads=6,
                              moe=dataclasses.replace(MIXTRAL.moe, num_experts=4))
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the model's 4 "
                                         "experts"):
        check_parallel(config(tensor_parallel_size=3, expert_parallel_size=3), six, None)
    check_parallel(config(tensor_parallel_size=2, expert_parallel_size=2), MIXTRAL, 2)


def test_expert_parallelism_spans_the_tensor_parallel_group():
    with pytest.raises(ValueError, match="expert_parallel_size=2 must be 1 or equal to "
                                         "tensor_parallel_size=1"):
        config(expert_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1, got 0"):
        config(pipeline_parallel_size=0)


def test_stages_split_layers_contiguously():
    assert stage_layers(5, 2) == [range(3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must be between 1 and"):
        stage_layers(2, 3)


def message(tokens_per_seq: list[int], microbatches: int) -> StepMessage:
    starts = [0]
    for n in tokens_per_seq:
        starts.append(starts[-1] + n)
    total = starts[-1]
    return StepMessage(0, (1,) * total, (0,) * total, tuple(range(total)), tuple(starts),
                       tuple(tokens_per_seq), ((0,),) * len(tokens_per_seq),
                       sum(n == 1 for n in tokens_per_seq), (), microbatches)


def test_decode_batches_split_into_balanced_microbatches_of_whole_sequences():
    assert split_microbatches(message([1] * 6, 2)) == [MicroBatch(0, 3, 0, 3),
                                                       MicroBatch(3, 6, 3, 6)]
    assert len(split_microbatches(message([1] * 2, 4))) == 2  # no empty micro-batch
    batches = split_microbatches(message([1, 1, 10, 1], 3))
    assert [b.num_tokens for b in batches] and sum(b.num_tokens for b in batches) == 13
    assert all(b.end_seq > b.first_seq for b in batches) and len(batches) == 3
    assert ideal_bubble_fraction(2, 1) == 0.5
    assert ideal_bubble_fraction(4, 4) == pytest.approx(3 / 7)
