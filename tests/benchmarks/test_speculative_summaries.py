"""What `speculative.py` and `speculative_llamacpp.py` report from their rounds: each method's
speedup over the same system without speculation, acceptance, and whether a greedy
speculative text differs from the plain one (the servers themselves: `--layer`, llama-server,
run by hand; their figures are in `benchmarks/results/`)."""

from __future__ import annotations

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def side_by_side():
    yield from import_benchmark("speculative_llamacpp")


@pytest.fixture(scope="module")
def speculative():
    yield from import_benchmark("speculative")


def measured(tokens_per_s, drafted=0, accepted=0, texts=("a", "b")):
    return {"tokens_per_s": tokens_per_s, "drafted": drafted, "accepted": accepted,
            "texts": list(texts)}


def test_side_by_side_ratios_are_per_system_and_against_the_matching_method(side_by_side):
    runs = {"chat": {
        "cleave_none": [measured(20), measured(22)],
        "cleave_ngram": [measured(30, 40, 20), measured(34, 40, 30)],
        "cleave_quantized_self": [measured(25, 40, 36), measured(27, 40, 36, ("a", "x"))],
        "llamacpp_none": [measured(10), measured(10)],
        "llamacpp_ngram": [measured(12, 10, 5), measured(12, 10, 5)],
        "llamacpp_ngramdefault": [measured(11), measured(11)],
        "llamacpp_draft_q4_1": [measured(13, 8, 8), measured(13, 8, 8)]}}
    out = side_by_side.summary(runs)
    assert out["cleave_ngram_chat_ratio"] == round(32 / 21, 3)  # medians over the same system
    assert out["llamacpp_draft_q4_1_chat_ratio"] == 1.3
    assert out["cleave_over_llamacpp_quantized_self_chat_ratio"] == round(26 / 13, 3)
    assert out["cleave_over_llamacpp_none_chat_ratio"] == 2.1
    assert out["chat"]["cleave_ngram"]["acceptance_rate"] == round(50 / 80, 3)
    assert out["chat"]["llamacpp_ngramdefault"]["acceptance_rate"] is None  # nothing drafted
    assert out["chat"]["cleave_ngram"]["same_texts_as_plain"]
    assert not out["chat"]["cleave_quantized_self"]["same_texts_as_plain"]  # greedy: a defect


def test_speculative_reports_mean_accepted_length_and_paired_ratios(speculative):
    runs = {"repeat_1": {"none": [measured(10) | {"tokens": 100}, measured(20) | {"tokens": 100}],
                         "ngram": [measured(15, 40, 30) | {"tokens": 100},
                                   measured(40, 40, 30) | {"tokens": 100}]}}
    out = speculative._summary(runs, "ngram")
    assert out["repeat_1"]["paired_ratios"] == [1.5, 2.0]
    assert out["repeat_1_ratio"] == round(27.5 / 15, 3)
    k = speculative.NGRAM["num_speculative_tokens"]  # drafted a step
    assert out["repeat_1"]["mean_accepted_length"] == 1 + 60 * k / 80
    assert out["repeat_1"]["same_texts"]


@pytest.fixture(scope="module")
def replay():
    yield from import_benchmark("speculative_replay")


def test_a_replay_accepts_drafts_up_to_the_first_token_the_output_did_not_have(replay):
    """An output that copies its prompt, then leaves it: drafts are accepted while the copy
    lasts; a step costs 1 + c per drafted token; the threshold back-off drafts less than the
    most, and the cost and match rules draft nothing where no draft can pay (c = 4)."""
    prompt = list(range(10, 40))
    output = [10, 11, *range(12, 40), *range(100, 105)]  # the prompt again, then new tokens
    fixed = replay.Replay("fixed", 4, 0.0).run([(prompt, output)])
    assert fixed["tokens_per_step"] > 2 and fixed["ratio"] == fixed["tokens_per_step"]
    costed = replay.Replay("fixed", 4, 0.25).run([(prompt, output)])
    assert costed["tokens_per_step"] == fixed["tokens_per_step"]
    assert costed["ratio"] < fixed["ratio"]
    assert replay.Replay("threshold", 4, 0.0).run([(prompt, output)])["tokens_per_step"] <= (
        fixed["tokens_per_step"])
    for policy in ("cost", "match"):
        assert replay.Replay(policy, 4, 4.0).run([(prompt, output)]) == {
            "tokens_per_step": 1.0, "ratio": 1.0}
    assert replay.Replay("match", 4, 0.0).run([(prompt, output)]) == fixed  # every row free


def test_the_oracle_bounds_every_policy_and_finds_the_occurrence_the_lookup_misses(replay):
    """Prompt lookup's bound: the latest occurrence after the longest match is not the one the
    output follows, an earlier one is; the oracle takes it, in one step, and no policy's replay
    beats it at any c."""
    prompt = [5, 1, 2, 3, 4, 6, 1, 2, 7, 8]
    output = [1, 2, 3, 4, 99]  # after the prefill's token 1: the first occurrence's 2 3 4
    assert replay.oracle([(prompt, output)], 4, 0.0) == {"tokens_per_step": 4.0, "ratio": 4.0}
    # one step verifying 3 drafted tokens: 4 tokens for 1 + 0.5 * 3
    assert replay.oracle([(prompt, output)], 4, 0.5)["ratio"] == 1.6
    # the lookup: no match at 1, the latest "1 2" (drafting 7 8, rejected) at 2, "2 3" at 3
    assert replay.Replay("fixed", 4, 0.0).run([(prompt, output)])["tokens_per_step"] == 1.333
    copying = (list(range(10, 40)), [10, 11, *range(12, 40), *range(100, 105)])
    for c in (0.0, 0.25):
        bound = replay.oracle([copying], 4, c)["ratio"]
        for policy in ("fixed", "threshold", "cost", "match"):
            assert replay.Replay(policy, 4, c).run([copying])["ratio"] <= bound


@pytest.fixture(scope="module")
def verify_cost():
    yield from import_benchmark("verify_cost")


def test_a_rows_floor_counts_its_products_at_the_probed_rates(verify_cost):
    """SmolLM2-135M's shapes: the linear layers' and output projection's multiply-adds per row
    (the figure verify_cost.json reports), attention's per token of context; the floor is
    those at 64 a byte dot product and 16 an FMA, shared by the threads."""
    from workers.models.model_config import ModelConfig

    smollm2 = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "num_hidden_layers": 30, "vocab_size": 49152,
        "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5})
    linear, attention = verify_cost.row_multiply_adds(smollm2)
    assert linear == 30 * (576 * 15 * 64 + 576 * 576 + 576 * 3072 + 1536 * 576) + 49152 * 576
    assert (linear, attention) == (134_479_872, 30 * 2 * 9 * 64)
    # 64e9 products at one dot product a nanosecond: one second; attention 16e9 likewise
    assert verify_cost.row_floor_seconds(64 * 10**9, 0, 100.0, 1.0, 1.0, 1) == 1.0
    assert verify_cost.row_floor_seconds(64 * 10**9, 16 * 10**7, 100.0, 1.0, 2.0, 2) == 0.75


def test_the_cost_for_a_target_is_the_largest_at_which_the_rule_still_reaches_it(
        verify_cost):
    copying = [(list(range(10, 40)), [10, 11, *range(12, 40), *range(100, 105)])]
    c = verify_cost.cost_for(copying, 2.0)
    assert 0.0 < c < 1.0
    assert verify_cost.Replay("match", verify_cost.K, c).run(copying)["ratio"] >= 2.0
    assert verify_cost.Replay("match", verify_cost.K, c + 0.01).run(copying)["ratio"] < 2.0
    assert verify_cost.cost_for(copying, 100.0) == 0.0  # not even with free rows


def test_the_port_probe_times_both_instructions(verify_cost):
    from workers.kernels import gguf_vnni

    if not gguf_vnni.available():
        pytest.skip("the probe needs AVX-512 VNNI, which this CPU lacks")
    # rates, not errors (2.1-2.3 a nanosecond measured here; timing is the benchmark's to judge)
    for kind in (0, 1):
        assert 0.0 < verify_cost.per_ns(kind, rounds=1_000_000, repeats=2) < float("inf")
