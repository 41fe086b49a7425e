"""Model definitions and checkpoint reading: the families' modules, their config readers
(`model_config` and the RoPE, MLA and MoE parts), dtypes, the loader, `cleave make-model`, and the
fused CPU decoder stack. The registry of families by architecture name is `registry`."""
