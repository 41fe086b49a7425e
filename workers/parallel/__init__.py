"""Parallelism inside one worker group: tensor, pipeline and expert parallelism over ranks.

The engine's scheduler runs once, in the driver; it sends each step to the ranks as one typed
`StepMessage` (messages.py), and the ranks (processes started by a `RankLauncher`, group.py) run
their shard of the model on their shard of the KV cache (rank.py, pipeline.py) and send the
logits back. On CPU the driver allocates the caches in a shared-memory file every rank maps
(shared_cache.py), so it (and the transfer layer) sees what the ranks write; on GPUs each rank
allocates its own on its device, and the group serves aggregated only. Importing this package does not import
torch.distributed's process groups.
"""
