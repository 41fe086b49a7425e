"""Drafting policies replayed on the real model's greedy outputs: how many tokens a step of
each policy yields, and what that is worth once each step is costed by its rows, without the
served system's noise (this machine's served ratios move 1.2-1.9x between rounds).

SmolLM2-135M-Instruct (the shipped Q4_1 file, served packed as `cleave serve` does) answers the
prompts of `speculative.py`'s workloads greedily, offline; then n-gram drafting (the engine's
`NgramDrafter`, vLLM's prompt lookup) is replayed on those outputs under each policy: a draft is
accepted up to its first token that differs from the recorded output, as greedy verification
accepts it. A step that verifies L drafted tokens costs 1 + c L one-row steps, c the cost of a
drafted token; the ratio is output tokens per unit of step cost against decoding one token a
step (ratio 1). Policies:

- `fixed`: the most (`num_speculative_tokens`) whenever the drafter has them (vLLM's);
- `threshold`: the back-off `cost` replaced (a request's acceptance, a moving average of its
  drafts' accepted share, below 0.3 pauses its drafting for 2, 4, 8 ... 64 steps);
- `cost`: the length rule (`workers.engine.speculative.draft_length`: the length maximizing
  expected tokens per step cost) at the request's measured acceptance, at the c it is replayed
  with (a draft model's rule, and the n-gram one's until 2026-11-30);
- `match_latest`: the same length rule at the acceptance measured for drafts copied after
  matches as long as the draft's own, copied after the match's latest occurrence (the engine's
  n-gram rule until 2026-12-01);
- `match`: the engine's n-gram rule (`MatchSpeculator`): `match_latest`, copied after the first
  occurrence onward of where the request's last draft reached in its source;
- `oracle` (`oracle`): the bound of every prompt-lookup policy, knowing the output: each step
  drafts the longest continuation of any earlier occurrence that the output follows, never a
  rejected row, in the fewest steps.

c: 0 (free verification: the drafts' own bound), this CPU's (0.11 on the VNNI kernel, 0.21 on
the block kernel: a 5-row step measured 1.45x and 1.85x a one-row step), and the c the engine's
`StepClock` fitted while speculating on the same prompts in this run (`measured_token_cost`).

    python benchmarks/speculative_replay.py [--int-kernels] [--k 4 8] \
        [--out benchmarks/results/speculative_replay.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from results_io import RESULTS, command_line, emit
from speculative import MAX_TOKENS, NGRAM, WORKLOADS

from workers import LLM, SamplingParams
from workers.engine.speculative.draft_length import (ACCEPTANCE_WEIGHT, PAUSE_STEPS,
                                                       PRIOR_ACCEPTANCE, MatchAcceptance,
                                                       StepClock, best_length, reached)
from workers.engine.speculative.drafter import NgramDrafter

COSTS = (0.0, 0.11, 0.21)
REQUESTS = 4  # of each workload, as `speculative.py` sends at one stream
Policy = Callable[[list[int], int, int], list[int]]


def greedy_outputs(llm: LLM, prompts: list[str], max_tokens: int) -> list[tuple[list, list]]:
    """(prompt ids, output ids) of each prompt, greedy, through the chat template."""
    outs = []
    for prompt in prompts:
        out = llm.chat([{"role": "user", "content": prompt}],
                       SamplingParams(max_tokens=max_tokens, temperature=0.0))
        outs.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
    return outs


class Replay:
    """One policy's replay over recorded outputs at a token cost `c`."""

    def __init__(self, policy: str, k: int, c: float) -> None:
        self.policy, self.k, self.c = policy, k, c
        self.drafter = NgramDrafter(NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"])
        self.matches = MatchAcceptance()  # the server's: over all requests replayed

    def run(self, outputs: list[tuple[list, list]]) -> dict[str, float]:
        tokens = steps = cost = 0.0
        for prompt, output in outputs:
            t, s, c = self._request(prompt, output)
            tokens, steps, cost = tokens + t, steps + s, cost + c
        return {"tokens_per_step": round(tokens / steps, 3), "ratio": round(tokens / cost, 3)}

    def _request(self, prompt: list[int], output: list[int]) -> tuple[int, int, float]:
        """Tokens after the first (the prefill's), steps, and their cost."""
        i, steps, cost, source = 1, 0, 0.0, None
        acceptance, rate, pause, next_pause = PRIOR_ACCEPTANCE, 1.0, 0, 2
        while i < len(output):
            length = min(self.k, len(output) - i)
            if pause:
                pause, length = pause - 1, 0
            elif self.policy == "cost":
                length = best_length(acceptance, self.c, length)
                if not length:
                    pause, acceptance = PAUSE_STEPS - 1, PRIOR_ACCEPTANCE
            after = source if self.policy == "match" else None
            draft, match, start = (self.drafter.lookup(prompt + output[:i], length, after)
                                   if length else ([], 0, 0))
            if self.policy.startswith("match") and draft:
                draft = draft[:self.matches.length(match, self.c, len(draft))]
            accepted = 0
            while accepted < len(draft) and draft[accepted] == output[i + accepted]:
                accepted += 1
            if draft:
                self.matches.record(match, accepted, len(draft))
                source = start + accepted + 1
                acceptance += ACCEPTANCE_WEIGHT * (accepted / reached(accepted, len(draft))
                                                   - acceptance)
                rate = 0.5 * rate + 0.5 * accepted / len(draft)
                if self.policy == "threshold" and rate < 0.3:
                    pause, next_pause, rate = next_pause, min(2 * next_pause, 64), 1.0
            steps += 1
            cost += 1.0 + self.c * len(draft)
            i += accepted + 1
        return len(output) - 1, steps, cost


def oracle(outputs: list[tuple[list, list]], k: int, c: float) -> dict[str, float]:
    """The bound of prompt lookup on `outputs`: at each position the longest run of the output
    that a continuation after an earlier occurrence of the history's last token (a match of 1
    or more) agrees with, at most k, and drafts cut to any length up to it (never a rejected
    row); the fewest steps over the whole output, by dynamic programming. A step verifying r
    tokens costs 1 + c r, so over n tokens the cost is c n + (1 - c) steps: no lookup policy
    yields more tokens per step cost at c < 1."""
    tokens = steps = 0
    for prompt, output in outputs:
        n = len(output)
        fewest = [0] * (n + 1)  # steps from position i to the end
        for i in range(n - 1, 0, -1):
            history = prompt + output[:i]
            most = 0
            for j in range(len(history) - 1):
                if history[j] == history[-1]:
                    run = 0
                    while (run < min(k, n - 1 - i) and j + 1 + run < len(history)
                           and history[j + 1 + run] == output[i + run]):
                        run += 1
                    most = max(most, run)
            fewest[i] = 1 + min(fewest[i + r + 1] for r in range(most + 1))
        tokens, steps = tokens + n - 1, steps + fewest[1]
    return {"tokens_per_step": round(tokens / steps, 3),
            "ratio": round(tokens / (c * tokens + (1 - c) * steps), 3)}


def speculating_clock(path: str, prompts: list[str], max_tokens: int, k: int,
                      int_kernels: bool) -> StepClock:
    """The engine's clock after it speculated on `prompts`, twice (the match rule, at most k)."""
    config = {**NGRAM, "num_speculative_tokens": k}
    llm = LLM(path, speculative_config=json.dumps(config), fp32_int_kernels=int_kernels)
    for prompt in prompts * 2:
        llm.chat([{"role": "user", "content": prompt}],
                 SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return llm.engine.speculator.clock


def measured_token_cost(path: str, prompts: list[str], max_tokens: int, k: int,
                        int_kernels: bool) -> float:
    """The c the engine's clock fits while it speculates on `prompts`."""
    return round(speculating_clock(path, prompts, max_tokens, k, int_kernels).token_cost, 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8],
                        help="num_speculative_tokens replayed")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=list(WORKLOADS))
    parser.add_argument("--int-kernels", action="store_true",
                        help="the GGUF VNNI kernel (--fp32-int-kernels): its own greedy texts")
    parser.add_argument("--out", default=str(RESULTS / "speculative_replay.json"))
    args = parser.parse_args(argv)
    from workers.models.trained_default import smollm2_gguf

    path = str(smollm2_gguf())
    llm = LLM(path, fp32_int_kernels=args.int_kernels)
    result: dict = {"int_kernels": args.int_kernels, "costs": list(COSTS)}
    for name in args.workloads:
        prompts = WORKLOADS[name][:REQUESTS]
        outputs = greedy_outputs(llm, prompts, MAX_TOKENS[name])
        measured = measured_token_cost(path, prompts, MAX_TOKENS[name], max(args.k),
                                       args.int_kernels)
        result[f"{name}_measured_token_cost"] = measured
        for k in args.k:
            for c in (*COSTS, measured):
                label = "measured" if c == measured and c not in COSTS else f"c{c}"
                for policy in ("fixed", "threshold", "cost", "match_latest", "match"):
                    replay = Replay(policy, k, c).run(outputs)
                    result[f"{name}_{policy}_k{k}_{label}"] = replay
                    result[f"{name}_{policy}_k{k}_{label}_ratio"] = replay["ratio"]
                bound = oracle(outputs, k, c)
                result[f"{name}_oracle_k{k}_{label}"] = bound
                result[f"{name}_oracle_k{k}_{label}_ratio"] = bound["ratio"]
        print(name, {key: v for key, v in result.items()
                     if key.startswith(name) and key.endswith("_ratio")}, flush=True)
    result["command"] = command_line(argv)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
