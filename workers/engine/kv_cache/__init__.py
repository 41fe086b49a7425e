"""The paged KV cache's bookkeeping: blocks, reference counts, the prefix cache and its events.

Pure Python: the tensors themselves belong to the runner; this package only hands out block ids.
"""

from workers.engine.kv_cache.block_pool import BlockPool, KVBlock
from workers.engine.kv_cache.events import KVEventLog
from workers.engine.kv_cache.ledger import LeaseLedger
from workers.engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "KVEventLog", "LeaseLedger"]
