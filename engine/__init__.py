"""Pagoda's engine. A module's folder says which process runs it:

- ``core/``: the engine process's scheduling core, no torch (requests, the queue, the
  block pool, the KV cache manager, the scheduler, the policy, the step loop);
- ``frontend/``: the engine process's asyncio client (AsyncEngine, LLM, output processing,
  detokenizing, the data-parallel router);
- ``executor/``: the engine process's handles on the worker processes (multiprocessing, Ray);
- ``worker/`` and ``models/``: the worker process (model runner, input batch, sampler, the
  model);
- the modules here: what both processes read (configuration, sampling parameters, the
  messages between them, outputs, errors, the model's config and loading).

``from pagoda import LLM, SamplingParams`` is the public entry point.
"""
