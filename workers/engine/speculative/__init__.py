"""Speculative decoding: drafts of a few tokens per request, verified in one target forward.

`config` (torch-free) parses `--speculative-config`; `drafter` holds the methods that propose
tokens from a token history (`Drafter`); `draft_model`, `quantized_self` and
`draft_checkpoint` the draft models (a truncated copy of the target on its cache; the target's
int4 copy, or a checkpoint of its own sharing the tokenizer, on a cache of its own: `own_cache`);
`mtp` the checkpoint's multi-token-prediction layer (DeepSeek-V3's) on a cache of its own;
`speculator` is the per-step policy that decides which requests draft and
how many tokens (the back-off); `verify` turns a verification step's sampled rows into the
accepted tokens; `rejection` is the acceptance rule for a draft with probabilities.
"""
