"""The cluster config's checks that are not one field's bound: a pool's shape against the
model's own config.json, loopback addresses, and pydantic's errors as one line each."""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import ValidationError


def check_against_model(config: Any, model_config: Any) -> list[str]:
    """The problems of `config`'s (a `CleaveConfig`) pool shapes for the model whose
    `workers.models.model_config.ModelConfig` is `model_config`; none: []."""
    problems = []
    heads = model_config.num_attention_heads
    kv_heads = model_config.num_key_value_heads
    layers = model_config.num_hidden_layers
    moe = getattr(model_config, "moe", None)
    experts = moe.num_experts if moe is not None else None
    for name, pool in config.pools.items():
        if heads % pool.tp:
            problems.append(f"pools.{name}.tp={pool.tp} does not divide the model's "
                            f"{heads} attention heads")
        if kv_heads % pool.tp:
            problems.append(f"pools.{name}.tp={pool.tp} does not divide the model's "
                            f"{kv_heads} KV heads")
        if pool.pp > layers:
            problems.append(f"pools.{name}.pp={pool.pp} is more than the model's {layers} "
                            f"layers")
        if pool.ep > 1 and not experts:
            problems.append(f"pools.{name}.ep={pool.ep} needs a mixture-of-experts model; "
                            f"this one has no experts")
        elif pool.ep > 1 and experts % pool.ep:
            problems.append(f"pools.{name}.ep={pool.ep} does not divide the model's "
                            f"{experts} experts")
    max_len = config.model.max_model_len
    if max_len is not None and max_len > model_config.max_position_embeddings:
        problems.append(f"model.max_model_len={max_len} is more than the model's context "
                        f"of {model_config.max_position_embeddings} tokens")
    return problems


def check_cores(cores: list[int] | None) -> list[int] | None:
    """A `cpu_affinity` list, or `ValueError` naming it."""
    if cores is None:
        return None
    if not cores or min(cores) < 0 or len(set(cores)) != len(cores):
        raise ValueError(f"cpu_affinity={cores}: expected distinct core numbers >= 0, at "
                         f"least one")
    return cores


# the autoscaling targets a pool of each kind does not scale on (prefill: waiting prompt tokens;
# decode and aggregated: KV occupancy and running sequences)
_UNUSED_TARGETS = {"prefill": ("target_kv_usage", "target_running_seqs"),
                   "decode": ("target_waiting_tokens",)}


def check_targets_used(pool: str, autoscaling: Any, defaults: Any) -> None:
    """`ValueError` when pool `pool` sets an autoscaling target (away from `defaults`) that a
    pool of its kind does not scale on, rather than dropping it."""
    for field in _UNUSED_TARGETS["prefill" if pool == "prefill" else "decode"]:
        value = getattr(autoscaling, field)
        if value != getattr(defaults, field):
            used = _UNUSED_TARGETS["decode" if pool == "prefill" else "prefill"]
            raise ValueError(f"{pool}.autoscaling.{field}={value}: the {pool} pool scales on "
                             f"{' and '.join(used)}")


def is_loopback(host: str) -> bool:
    """True for an address (or name) only this machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def format_errors(exc: ValidationError) -> str:
    """One line per problem: `pools.decode.tp: Input should be greater than or equal to 1
    (got 0)`."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err['input']!r})"
        if err["type"] == "model_type" or isinstance(err["input"], dict):
            got = ""
        lines.append(f"{where}: {msg}{got}")
    return "; ".join(lines)
