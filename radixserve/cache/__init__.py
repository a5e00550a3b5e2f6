"""KV memory: the slot allocator, the prefix-cache contract, and the per-layer KV tensors (pool.py)."""
