"""Async scheduling (`EngineConfig.async_scheduling`): the host plans step N+1 while step N runs.

Each `AsyncStepper.step()`:

1. with step N in flight (launched, its tokens on their way to the host), schedule step N+1
   (`Scheduler.schedule(lookahead=True)`): each request N samples for counts a placeholder for
   that token, and its decode in N+1 takes N's token on the device, by row (`TokenFill`): no
   host round trip. Build N+1's inputs and launch it (`ModelRunner.launch`);
2. wait for N's tokens (copied non-blocking into pinned memory, with an event: the step's one
   host synchronisation) and process them while N+1 runs: `Scheduler.record` (stop checks,
   finishes), stop strings, grammars, events (the engine's `emit`);
3. N+1 stays in flight for the next call.

So the events of step N come out of the call that launches step N+1: the same events as the
synchronous engine, one call later. A request that ends at N (max_tokens, EOS, a stop token, a
stop string found on the host) may already be in N+1: its N+1 token is never recorded (`record`
skips finished requests), the KV N+1 writes past its end is given up with its blocks
(`Scheduler.finish` rolls its computed tokens back first, so nothing past its end is cached),
and no event follows its last. Requests that surely end at N (max_tokens, the model's length)
are not scheduled into N+1 at all. An abort between calls is the same case.

Where a step cannot be planned before the previous one's tokens are known, the stepper waits for
them first: a synchronous step (process N, then schedule and launch N+1). It does so when

- a request N samples for needs its previous token on the host to sample the next: a grammar
  (the mask follows the accepted tokens), penalties or logit_bias (their device state follows
  the output), min_tokens not reached yet (stop tokens masked by count), a seeded random draw
  (its seed follows the output position);
- planning N+1 would take a preemption (`schedule(lookahead=True)` returns None): the synchronous
  schedule after N's tokens decides it, with the finished requests' blocks back in the pool;
- nothing is in flight (the first step, or after `drain`).

A step with prompt-logprob rows runs as usual but reads those logprobs at launch (a host wait of
its own: that step does not overlap). The engine's verbs that hand KV to another worker or read a
request's computed state (`pause`, `export_running`, `export_prefix`, `reserve_prefix`, the
handoff's `continue_with_kv`) `drain` first: the step in flight is processed and its events are
returned by the next `step()`.

With a step in flight the scheduler has already counted its KV as computed (`Scheduler.commit`):
later steps are ordered after it on the device, so blocks it writes may be hit, reused and freed
by the host at once. Only a single-process executor takes device inputs (`LocalExecutor`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.contract.protocol import TokenEvent
from workers.engine.request import Request
from workers.engine.runner import Launched, ModelRunner, RunnerOutput
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_records import SchedulerOutput
from workers.engine.step_costs import StepCosts

# records a step's tokens in the scheduler: `Scheduler.update` or `Scheduler.record`
Recorder = Callable[[SchedulerOutput, dict[str, int]], list[Request]]
# the engine's host work on a step's results, recording them with the recorder -> events
Emit = Callable[[SchedulerOutput, RunnerOutput, Recorder], list[TokenEvent]]


def needs_host_tokens(req: Request) -> bool:
    """Whether sampling `req`'s next token needs its previous one recorded on the host first."""
    p = req.params
    return (req.grammar is not None or p.repetition_penalty != 1.0 or bool(p.logit_bias)
            or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or req.num_output_tokens < p.min_tokens or (p.seed is not None and not p.greedy))


class AsyncStepper:
    """The engine's step loop with one step in flight. Not thread-safe (the engine's caller
    drives it, as it drives `Engine.step`)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, costs: StepCosts,
                 emit: Emit) -> None:
        self.scheduler, self.runner, self.costs, self.emit = scheduler, runner, costs, emit
        self._in_flight: Launched | None = None
        self._drained: list[TokenEvent] = []  # events of a drained step, for the next step()
        self.num_overlapped = 0  # steps launched before the previous one's tokens were read
        self.num_synchronous = 0  # steps launched after (nothing in flight, or a fallback)

    @property
    def busy(self) -> bool:
        """True while a step is in flight or a drained step's events wait for `step()`."""
        return self._in_flight is not None or bool(self._drained)

    def step(self) -> list[TokenEvent]:
        """Launch the next step and return the events of the one before (see the module)."""
        events, self._drained = self._drained, []
        prev, self._in_flight = self._in_flight, None
        launched = None
        if prev is not None and not any(needs_host_tokens(r) for r in prev.sampling
                                        if not r.is_finished):
            out = self.scheduler.schedule(lookahead=True)
            if out is not None and not out.is_empty:
                launched = self._launch(out, prev)
                self.num_overlapped += 1
        if prev is not None:
            events += self._process(prev)
        if launched is None:
            out = self.scheduler.schedule()
            if out is not None and not out.is_empty:
                launched = self._launch(out, None)
                self.num_synchronous += 1
        self._in_flight = launched
        return events

    def drain(self) -> None:
        """Process the step in flight now (its events come out of the next `step()`)."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            self._drained += self._process(prev)

    def _launch(self, out: SchedulerOutput, prev: Launched | None) -> Launched:
        launched = self.runner.launch(out, prev)
        self.scheduler.commit(out)
        return launched

    def _process(self, launched: Launched) -> list[TokenEvent]:
        result = self.runner.collect(launched)
        out = launched.out
        # launch to tokens on the host: an overlapped step's time includes the next launch
        self.costs.record_step(time.perf_counter() - launched.started,
                               launched.tier_copy_s, out.block_copies,
                               out.num_batched_tokens, out.num_decodes)
        return self.emit(out, result, self.scheduler.record)
