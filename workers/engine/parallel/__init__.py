"""Parallelism inside one worker group: tensor, pipeline and expert parallelism over ranks.

The engine's scheduler runs once, in the driver; it sends each step to the ranks as one typed
`StepMessage` (messages.py), and the ranks (processes started by a `RankLauncher`, group.py) run
their shard of the model on their shard of the KV cache (rank.py, pipeline.py); the last
stage's first TP rank samples and sends the token ids back (sampling.py). Each rank allocates
its own cache on its device and hands it off through its own transfer agent
(`kvtransfer.agent_host.AgentHost`), on GPUs and on the CPU alike; only a
pipeline-parallel CPU group maps caches the driver allocated in shared memory (shared_cache.py),
served by the driver's agents. Importing this package does not import
torch.distributed's process groups.
"""
