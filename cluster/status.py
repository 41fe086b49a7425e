"""`cleave status`: a running deployment's pools, replicas, load and routing figures.

Replica counts come from Serve; each worker's queue, running sequences and KV occupancy (and,
where it decodes speculatively, its drafted tokens and acceptance rate; where it serves LoRA
adapters, those in its engine's device slots), the router's prefix-hit rates, and the SLO
planner's plan (the leading replica's, as that one follows it) and its decisions, from one
router replica (`RouterIngress.status`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cluster.app_state import APP_NAME

if TYPE_CHECKING:
    from workers.contract.protocol import EngineStats


def cluster_status(address: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    """Raises `ValueError` when no Cleave application runs at the address."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto",
                 log_to_driver=False)
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        raise ValueError(f"no Cleave application ({APP_NAME!r}) is running on this Ray cluster")
    deployments = {name: {"status": d.status.value,
                          "replicas": {str(k).split(".")[-1].lower(): v
                                       for k, v in d.replica_states.items()}}
                   for name, d in app.deployments.items()}
    router = serve.get_deployment_handle("router", app_name=APP_NAME)
    seen = router.status.remote().result(timeout_s=timeout_s)
    prompt = seen["num_prompt_tokens"]
    return {"application": app.status.value, "deployments": deployments, **seen,
            "predicted_prefix_hit_rate": seen["num_predicted_cached_tokens"] / prompt
            if prompt else None,
            "prefix_hit_rate": seen["num_cached_tokens"] / prompt if prompt else None}


def speculation(stats: EngineStats | None) -> dict[str, Any] | None:
    """A worker's speculative decoding as `cleave status` shows it: its method, drafted tokens
    verified, the share accepted and the mean accepted length (vLLM's: tokens a verified draft
    yields, its accepted ones and the target's next; None: unknown, or no speculation)."""
    if stats is None or stats.speculative_method is None:
        return None
    drafted, accepted, drafts = (stats.num_draft_tokens, stats.num_accepted_tokens,
                                 stats.num_drafts)
    return {"method": stats.speculative_method, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "num_drafts": drafts,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def format_status(s: dict[str, Any]) -> str:
    lines = [f"application {APP_NAME}: {s['application'].lower()}, model {s['model']}"]
    for name, d in sorted(s["deployments"].items()):
        counts = ", ".join(f"{n} {state}" for state, n in sorted(d["replicas"].items())
                           if n) or "0 replicas"  # a pool scaled to zero
        lines.append(f"  {name:<16} {d['status'].lower():<10} {counts}")
    lines.append("workers (as router replica " + s["router"] + " sees them):")
    lines.append(f"  {'worker':<24} {'role':<8} {'state':<9} {'waiting':>7} {'running':>7} "
                 f"{'kv used':>8}")
    for w in s["workers"]:
        state = "draining" if w["draining"] else ("ok" if w["healthy"] else "down")
        kv = "-" if w["kv_usage"] is None else f"{100 * w['kv_usage']:.1f}%"
        role = w["role"] if w.get("routed_as", w["role"]) == w["role"] else \
            f"{w['role']}>{w['routed_as']}"  # a "both" worker switched (`cleave role`)
        lines.append(f"  {w['worker_id']:<24} {role:<8} {state:<9} "
                     f"{_num(w['num_waiting']):>7} {_num(w['num_running']):>7} {kv:>8}")
        spec = w.get("speculative")
        if spec is not None:
            length = spec.get("mean_accepted_length")
            lines.append(f"    speculative {spec['method']}: {spec['num_draft_tokens']} drafted "
                         f"tokens verified, {_pct(spec['acceptance_rate'])} accepted, mean "
                         f"accepted length {'-' if length is None else f'{length:.2f}'}")
        if w.get("lora_adapters"):
            lines.append(f"    lora adapters in slots: {', '.join(w['lora_adapters'])}")
    hit = s["prefix_hit_rate"]
    predicted = s["predicted_prefix_hit_rate"]
    lines.append(f"requests {s['num_requests']}, prompt tokens {s['num_prompt_tokens']}, "
                 f"prefix hit {_pct(hit)} (predicted {_pct(predicted)}), "
                 f"fallbacks {s['fallbacks'] or 'none'}")
    lines.extend(planner_lines(s.get("planner")))
    return "\n".join(lines)


def planner_lines(p: dict[str, Any] | None) -> list[str]:
    """The SLO planner's part of `cleave status` (none without SLO targets)."""
    if p is None:
        return []
    decided = ", ".join(f"{k} {n}" for k, n in sorted(p["decisions"].items())) or "none"
    role = "decides" if p["leader"] else "follows"
    plan = p["plan"]
    if plan is None:
        why = p.get("waiting") or "none made yet"
        return [(f"SLO planner: no plan: {why} (router {p['replica']} {role}; decisions "
                 f"{decided})")]
    asked = plan["replicas"]  # every role's pool, one the plan empties at 0
    replicas = ", ".join(f"{r} {asked[r]}" for r in ROLES if r in asked) or \
        "none (no workers known: the pools' load rule applies)"
    short = "" if plan["feasible"] else " (targets out of reach within the bounds)"
    head = (f"SLO planner: {plan['prefill']} prefill + {plan['decode']} decode workers, "
            f"threshold {plan['threshold']}, {plan['kind']}{short}; decided by {plan['holder']}")
    return [head,
            f"  replicas asked: {replicas}; this replica {role}, its decisions: {decided}",
            f"  why: {plan['reason']}"]


ROLES = ("prefill", "decode", "both")  # the plan's replica counts, in the order shown


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
