"""The model's compiled regions, kept on disk whole so that a later start does not trace them again.

torch.compile traces a function with dynamo in every new process, even when inductor's code
comes from its cache: with the default model that was about 7 s of each start, and so of each
worker restart after a crash. torch's ``aot_compile`` saves a traced and compiled function
whole (its bytecode, its guards, inductor's code); loading one takes tens of milliseconds once
torch's compiler is imported, and calling it costs no more than the function torch.compile
returns (outputs equal bit for bit: tests/test_precompiled.py).

A region gets one compiled function per variant of its inputs: torch.compile compiles a
one-token batch apart from larger ones, and layers whose weights are packed differently
(a GGUF file that mixes types) take different code. Each call checks the guards of the
variant last chosen for the same modules and batch kind; a call that no variant accepts is
compiled there and then, and saved beside the others (``<directory>/<region>-<digest of its
bytes>.bin``, written under a temporary name and renamed, so concurrent workers never read half
a file).

The directory is named by everything that shapes the code (:func:`cache_key`): the sources
the regions trace, torch's and Python's versions, the CPU's flags and count, the threads, the
environment that changes inductor's code (ATEN_CPU_CAPABILITY, PAGODA_CPU_MARCH,
TORCHINDUCTOR_*), the model's configuration, the dtype and the weights' packings. The guards
are checked on every call all the same. Loading a file unpickles it: the cache directory must
be as trusted as inductor's own cache.

NOTE: ``aot_compile`` is marked experimental in torch 2.13 (the version the ``cpu`` extra
pins). Wherever it fails (a region with a graph break, caches turned off), the region falls
back to plain torch.compile, with a log line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The prefill the model runner warms up with, which compiles the regions' variant of many
# tokens: inductor makes a kernel parallel by the sizes of its first compile (at 2 tokens, the
# rotary embedding ran on one thread of every prefill step).
WARM_UP_PREFILL_TOKENS = 256

# The code the regions trace: the model's modules, and the tensor-parallel helpers they call.
SOURCES = (*sorted(Path(__file__).parent.glob("*.py")), Path(__file__).parent.parent / "worker" / "distributed.py")


def cache_key(*parts: object) -> str:
    """A digest of ``parts`` (anything that shapes the compiled code, by repr) with the
    sources the regions trace, the versions of torch and Python, the CPU's flags, the
    threads, and the environment variables that change inductor's code."""
    from pagoda.native.library import MARCH_ENV, cpu_flags

    # NOTE: ATEN_CPU_CAPABILITY caps inductor's vector code (inductor's own cache does not key on
    # it); inductor writes the thread count into its code unless it is the CPU count.
    environment = sorted((name, value) for name, value in os.environ.items()
                         if name in ("ATEN_CPU_CAPABILITY", MARCH_ENV, "OMP_NUM_THREADS")
                         or name.startswith("TORCHINDUCTOR_") and name != "TORCHINDUCTOR_CACHE_DIR")
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, cpu_flags(), torch.get_num_threads(), os.cpu_count(),
                 *map(repr, environment), *(p.read_bytes() for p in SOURCES), *map(repr, parts)):
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def import_loader() -> None:
    """Imports what loading a compiled region needs, and has inductor probe the CPU's vector
    instruction sets (it builds and loads a library per set, in subprocesses): 3-5 s of a
    start, for a standby worker to do ahead (engine/worker/main.py)."""
    import torch._dynamo.aot_compile  # noqa: F401
    import torch._functorch._aot_autograd.aot_autograd_result  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.output_code  # noqa: F401
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()  # NOTE: cached for the process (functools.cache)


class _Compiled:
    """A region compiled by plain torch.compile (the fallback): it guards itself."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def guard_check(self, *args) -> bool:
        return True


class PrecompiledRegion:
    """A function compiled ahead of time per variant of its inputs, kept in ``directory``.

    Args:
        fn: The region (a plain function of modules and tensors, without graph breaks).
        directory: Where its compiled variants are kept (None: compiled, not kept).
        options: inductor's options, as for torch.compile.
    """

    def __init__(self, fn: Callable, directory: Path | None, options: dict) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.directory = directory
        self.options = options
        self.variants: list | None = None  # loaded at the first call, in the mode (inference) of the calls
        self.loaded = self.compiled = 0
        self._chosen: dict[tuple, object] = {}
        self._fallback: _Compiled | None = None

    def __call__(self, *args):
        key = tuple(id(a) if isinstance(a, nn.Module) else a.shape[0] == 1 for a in args)
        variant = self._chosen.get(key)
        if variant is None or not variant.guard_check(*args):
            variant = self._chosen[key] = self._choose(args)
        return variant.fn(*args)

    def _load(self) -> list:
        variants = []
        for path in sorted(self.directory.glob(f"{self.name}-*.bin")) if self.directory is not None else ():
            try:
                with open(path, "rb") as f:
                    variants.append(torch.compiler.load_compiled_function(f))
            except Exception as exc:  # noqa: BLE001 - a stale or broken file is compiled again
                logger.warning("could not load the compiled region %s (%s); it will be compiled again", path, exc)
        self.loaded = len(variants)
        return variants

    def _choose(self, args: tuple):
        if self.variants is None:
            self.variants = self._load()
        for variant in self.variants:
            if variant.guard_check(*args):
                return variant
        if self._fallback is not None:
            return self._fallback
        try:
            compiled = torch.compile(self.fn, dynamic=True, fullgraph=True, options=self.options).aot_compile(
                (args, {}))
        except Exception as exc:  # noqa: BLE001 - torch.compile without saving still works
            logger.info("compiling %s ahead of time failed (%s: %s); it is compiled by torch.compile "
                        "at every start instead", self.name, type(exc).__name__, exc)
            self._fallback = _Compiled(torch.compile(self.fn, dynamic=True, options=self.options))
            return self._fallback
        self.variants.append(compiled)
        self.compiled += 1
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                # NOTE: named by content, so workers that compile the same variant at once
                # write one file, not a copy each.
                data = type(compiled).serialize(compiled).serialized_data
                path = self.directory / f"{self.name}-{hashlib.sha256(data).hexdigest()[:12]}.bin"
                if not path.exists():
                    fd, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(temporary, path)
            except Exception as exc:  # noqa: BLE001 - serving goes on; the next start compiles again
                logger.warning("could not save the compiled region %s in %s: %s", self.name, self.directory, exc)
        return compiled
