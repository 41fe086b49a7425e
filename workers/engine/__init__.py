"""The inference engine core: requests, the scheduler, the paged KV cache, the runner and
sampler, parallel rank groups, the async engine and its output hub."""
