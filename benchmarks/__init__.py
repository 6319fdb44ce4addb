"""`pagoda bench ...`: throughput against peers, KV-cache, preemption, plugin and overhead benchmarks."""
