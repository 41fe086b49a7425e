"""`--speculative-config`: vLLM's JSON shape, parsed and validated into one frozen record.
Torch-free (the engine's config validates it at construction)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

# "mtp" and "deepseek_mtp" (vLLM's two names) draft with the checkpoint's own
# multi-token-prediction layer (DeepSeek-V3's)
MTP_METHODS = ("mtp", "deepseek_mtp")
METHODS = ("ngram", "draft_model", "quantized_self", *MTP_METHODS)
DRAFT_LENGTHS = ("cost", "fixed")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a server drafts. Keys as vLLM's `--speculative-config` spells them; `draft_length`
    is Cleave's (vLLM's `disable_by_batch_size` kept its name)."""

    # "ngram": prompt lookup; "draft_model": a checkpoint of its own (`model`) or a truncated
    # copy of the target; "quantized_self":
    # the target's own weights quantized to int4 at start, all layers, with a cache of its own;
    # "mtp" / "deepseek_mtp": the checkpoint's multi-token-prediction layer, with a cache of its own
    method: str
    num_speculative_tokens: int  # tokens drafted per request per step at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the request's tokens
    prompt_lookup_min: int = 2  # ngram: the shortest suffix that counts as a match
    # draft_model: a checkpoint sharing the target's tokenizer (a folder or a GGUF file), on a
    # cache of its own (`workers.engine.speculative.draft_checkpoint`); None: the target's first
    # `draft_num_layers` layers (with its final norm and head) on the target's cache
    model: str | None = None
    draft_num_layers: int = 1
    # no request drafts in a step with more running requests than this: verification costs
    # k + 1 positions a request, and on the CPU a verifying step leaves the fused decode path
    # (`workers.models.fused_layer` takes decode rows only); 8 streams of SmolLM2 measured
    # 0.47x with drafting (benchmarks/results/speculative.json)
    disable_by_batch_size: int = 2
    # Cleave's: "cost", each request's draft length the one that yields the most tokens per
    # second of steps, from its measured acceptance and the measured cost of a drafted token
    # (0 where drafting does not pay: `workers.engine.speculative.draft_length`); "fixed",
    # num_speculative_tokens whenever the method has that many (vLLM's)
    draft_length: str = "cost"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got "
                             f"{self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "draft_num_layers", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got "
                                 f"{value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} "
                             f"must be <= prompt_lookup_max={self.prompt_lookup_max}")
        if self.model is not None and (self.method != "draft_model"
                                       or not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config model names a draft checkpoint for method "
                             f"'draft_model' (a non-empty path), got model={self.model!r} with "
                             f"method {self.method!r}")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config draft_length must be one of {DRAFT_LENGTHS}, "
                             f"got {self.draft_length!r}")

    @property
    def drafts_beside_the_target(self) -> bool:
        """Whether the drafts need none of the target's weights in this process (n-gram
        lookup, a checkpoint of its own): so the target may run on a group of ranks."""
        return self.method == "ngram" or self.model is not None


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The record of a `--speculative-config` JSON object; None for None or "" (no
    speculation). ValueError naming the bad key or value."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config must be a JSON object, got {text!r}: {exc}") \
            from None
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; expected some of "
                         f"{sorted(known)}")
    for name in ("method", "num_speculative_tokens"):
        if name not in raw:
            raise ValueError(f"speculative_config needs {name!r}, got {text!r}")
    return SpeculativeConfig(**raw)
