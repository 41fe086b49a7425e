"""A worker's step costs as the SLO planner reads them, and fitting them from observed steps.
Torch-free.

`StepProfile` is a linear cost model (seconds):

    prefill_s(tokens)            = steps × prefill_fixed_s + prefill_s_per_token × tokens
                                   (steps: one per `chunk_tokens` of the prompt)
    decode_step_s(batch, ctx)    = decode_fixed_s + batch × (decode_s_per_seq
                                                            + ctx × decode_s_per_ctx_token)
    handoff_s(tokens)            = handoff_fixed_s + tokens × handoff_s_per_token
                                   (a disaggregated prompt's end to its first token: the
                                   prefill call's return with its KV offer)
    transfer_s(tokens)           = tokens × transfer_s_per_token (the KV pull after it)

`ProfileFitter` fits one from a worker's steps as the router sees them: each pushed report is
one engine step (`WorkerOutputs`, one per step), so a report's interval after the previous one,
with the running batch and its context, is a decode step's cost; the measured
`EngineStats.prefill_s_per_token` is the prefill rate. The fit is least squares over a bounded
window of recent steps (refined as the worker runs), clamped to non-negative coefficients.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class StepProfile:
    """One worker's step costs (seconds). `max_batch`: sequences a decode step may run;
    `chunk_tokens`: prompt tokens one step computes at most (chunked prefill)."""

    prefill_fixed_s: float
    prefill_s_per_token: float
    decode_fixed_s: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float = 0.0
    transfer_s_per_token: float = 0.0  # a handoff's KV pull, per prompt token
    handoff_fixed_s: float = 0.0  # a prefill's end to its first token, disaggregated
    handoff_s_per_token: float = 0.0  # ... and per prompt token
    max_batch: int = 256
    chunk_tokens: int = 2048
    source: str = "measured"  # where the figures come from ("measured", "gpu_roofline", ...)

    def __post_init__(self) -> None:
        for name in ("prefill_fixed_s", "prefill_s_per_token", "decode_fixed_s",
                     "decode_s_per_seq", "decode_s_per_ctx_token", "transfer_s_per_token",
                     "handoff_fixed_s", "handoff_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepProfile.{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_s_per_token <= 0 or self.decode_fixed_s + self.decode_s_per_seq <= 0:
            raise ValueError(f"a profile needs a prefill and a decode cost, got "
                             f"prefill_s_per_token={self.prefill_s_per_token}, decode_fixed_s="
                             f"{self.decode_fixed_s}, decode_s_per_seq={self.decode_s_per_seq}")
        if self.max_batch < 1 or self.chunk_tokens < 1:
            raise ValueError(f"max_batch and chunk_tokens must be >= 1, got {self.max_batch} "
                             f"and {self.chunk_tokens}")

    def prefill_s(self, tokens: float) -> float:
        """A prompt of `tokens` uncached tokens to its first token, alone on the worker (one
        step per `chunk_tokens` of it)."""
        steps = max(1, math.ceil(tokens / self.chunk_tokens))
        return steps * self.prefill_fixed_s + self.prefill_s_per_token * tokens

    def decode_step_s(self, batch: float, context: float) -> float:
        """One decode step of `batch` sequences of `context` tokens each on average."""
        return self.decode_fixed_s + batch * (self.decode_s_per_seq
                                              + context * self.decode_s_per_ctx_token)

    def handoff_s(self, tokens: float) -> float:
        """A disaggregated prompt of `tokens`: its prefill's end to its first token."""
        return self.handoff_fixed_s + self.handoff_s_per_token * tokens

    def transfer_s(self, tokens: float) -> float:
        """Its KV pulled by the decode worker, after the first token."""
        return self.transfer_s_per_token * tokens


class ProfileFitter:
    """A worker's `StepProfile`, fitted from its recent decode steps and prefill rate. Starts
    from `prior` (a calibration pass's or a peer's figures) and refines it as steps arrive;
    with no prior, there is a profile once both are measured."""

    def __init__(self, prior: StepProfile | None = None, window: int = 512,
                 min_samples: int = 16) -> None:
        if window < min_samples or min_samples < 3:
            raise ValueError(f"need window >= min_samples >= 3, got {window} and {min_samples}")
        self.prior = prior
        self.min_samples = min_samples
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._prefill_s_per_token = 0.0

    def observe_decode(self, batch: int, context: float, step_s: float) -> None:
        """A pure decode step of `batch` sequences (mean context `context`) took `step_s`."""
        if batch >= 1 and step_s > 0:
            self._steps.append((float(batch), float(batch) * context, step_s))

    def observe_prefill_rate(self, s_per_token: float) -> None:
        """The worker's measured prefill seconds per token (`EngineStats`); 0: not yet."""
        if s_per_token > 0:
            self._prefill_s_per_token = s_per_token

    def profile(self) -> StepProfile | None:
        """The prior with what was observed fitted in: decode coefficients once `min_samples`
        steps with at least two batch sizes were seen; the prefill rate once measured. None
        without a prior until both are."""
        out = self.prior
        if out is None:
            fitted = self._fit_decode()
            if fitted is None or not self._prefill_s_per_token:
                return None
            return StepProfile(0.0, self._prefill_s_per_token, *fitted)
        if self._prefill_s_per_token:
            out = replace(out, prefill_s_per_token=self._prefill_s_per_token)
        fitted = self._fit_decode()
        if fitted is None:
            return out
        return replace(out, decode_fixed_s=fitted[0], decode_s_per_seq=fitted[1],
                       decode_s_per_ctx_token=fitted[2])

    def _fit_decode(self) -> tuple[float, float, float] | None:
        """(fixed, per sequence, per context token) seconds, least squares; None until
        `min_samples` steps of at least two batch sizes were seen."""
        if len(self._steps) < self.min_samples:
            return None
        data = np.array(self._steps)  # [n, 3]: batch, batch × context, seconds
        if len(np.unique(data[:, 0])) < 2:
            return None
        ctx_varies = np.ptp(data[:, 1] / data[:, 0]) > 0
        columns = [np.ones(len(data)), data[:, 0]] + ([data[:, 1]] if ctx_varies else [])
        coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), data[:, 2], rcond=None)
        coef = np.maximum(coef, 0.0)
        if coef[0] + coef[1] <= 0:
            return None
        return float(coef[0]), float(coef[1]), float(coef[2]) if ctx_varies else 0.0


__all__ = ["ProfileFitter", "StepProfile"]
