"""`pagoda simulate`: the engine's own scheduler, KV cache manager and plugins on a
step-time model of a device, in virtual time (see docs/simulate.md)."""
