"""Moving paged KV blocks between workers (TCP, UCX, NCCL). Imports no other Cleave package."""
