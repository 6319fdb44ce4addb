"""Pagoda's CPU kernels (csrc/: paged attention, attention on tiles, the bfloat16 and quantized
matrix products, the whole step in one call), built on first use with the machine's C compiler
into one library, and bound from the one declaration of their interface, csrc/pagoda_kernels.h.

This is the floor below the model and the attention backends: it imports nothing of Pagoda's.
native/linear.py wraps the matrix products, attention_backends/cpu_kernels.py the attention.

The library is compiled for this CPU (``-march=native``; ``PAGODA_CPU_MARCH=x86-64-v3``
builds the AVX2 paths instead, to test them on an AVX-512 machine) and cached under
``$PAGODA_CACHE_DIR/kernels`` (default ``~/.cache/pagoda/kernels``), keyed by the
source, the compiler and the CPU's feature flags; later starts load it in milliseconds.
Without a C compiler (or with ``PAGODA_DISABLE_CPU_KERNELS=1``) nothing is built: a WARNING
says so once, and the paths that need the kernels give way to torch's (oneDNN's products, the
torch_sdpa attention backend).

The interface: every function the library exports is declared once, in csrc/pagoda_kernels.h,
which every source file includes, so the compiler checks each definition against it; load()
reads the same declarations to give each function its ctypes argument and return types, fails
for a declared function the library lacks, and exposes no undeclared one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from pagoda.environment import cache_dir, read, read_flag

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (_CSRC / "paged_attention.c", _CSRC / "packed_linear.c", _CSRC / "tile_attention.c",
           _CSRC / "quant_linear.c", _CSRC / "one_call_forward.c")
HEADER = _CSRC / "pagoda_kernels.h"  # the interface: every exported function, declared once
HEADERS = (HEADER, _CSRC / "vector_exp.h", _CSRC / "vector_lanes.h", _CSRC / "amx_tiles.h",
           _CSRC / "work_share.h")
DISABLE_ENV = "PAGODA_DISABLE_CPU_KERNELS"
# NOTE: never -ffast-math: linking with it turns on flush-to-zero for the whole process
# (crtfastmath), which changes every float result in it. These are the parts of it that
# let the compiler vectorize the generic path's sums, without that side effect.
_FLAGS = ["-O3", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-fopenmp", "-shared", "-fPIC"]
MARCH_ENV = "PAGODA_CPU_MARCH"


def _flags() -> list[str]:
    """The compiler flags: the tuning above, for this CPU or the one MARCH_ENV names."""
    return [f"-march={read(MARCH_ENV) or 'native'}", *_FLAGS]


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here."""


def _cache_dir() -> Path:
    return cache_dir() / "native"


def cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc)")
    return compiler


def _parallel_builds() -> int:
    return max(1, min(len(SOURCES), os.cpu_count() or 1))


def _compile_each(compiler: str, flags: list[str], objects: Path) -> list[Path]:
    """Compiles every source to an object file, as many at once as the machine has cores, and
    logs each file as it finishes with its time (the first build takes minutes on 2 cores).

    Raises:
        KernelUnavailable: A file does not compile (with the compiler's message).
    """
    pending = list(SOURCES)
    running: dict[subprocess.Popen, tuple[Path, float]] = {}
    built = []
    while pending or running:
        while pending and len(running) < _parallel_builds():
            source = pending.pop(0)
            out = objects / (source.stem + ".o")
            # NOTE: messages to a file, not a pipe that a compiler's many warnings could fill.
            with open(objects / (source.stem + ".log"), "w") as log:
                process = subprocess.Popen([compiler, *flags, "-c", "-o", str(out), str(source)],
                                           stdout=subprocess.DEVNULL, stderr=log)
            running[process] = (source, time.perf_counter())
            built.append(out)
        process = _wait_any(running)
        source, began = running.pop(process)
        stderr = (objects / (source.stem + ".log")).read_text()
        if process.returncode != 0:
            for other in running:
                other.kill()
            raise KernelUnavailable(f"compiling {source.name} failed:\n{stderr.strip()}")
        logger.info("compiled %s in %.1f s (%d of %d)", source.name, time.perf_counter() - began,
                    len(SOURCES) - len(pending) - len(running), len(SOURCES))
    return built


def _wait_any(running: dict[subprocess.Popen, tuple[Path, float]]) -> subprocess.Popen:
    while True:
        for process in running:
            if process.poll() is not None:
                return process
        time.sleep(0.05)


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    flags = _flags()
    key = hashlib.sha256("\0".join([*texts, compiler, version, cpu_flags(), *flags]).encode())
    target = _cache_dir() / f"pagoda_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: built under a temporary name and renamed, so concurrent builds (several
    # workers starting at once) never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    logger.info("building the CPU kernels with %s: %d files, %d at a time (once per machine and source version)",
                compiler, len(SOURCES), _parallel_builds())
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            built = _compile_each(compiler, flags, Path(objects))
            result = subprocess.run([compiler, *flags, "-o", tmp, *map(str, built), "-lm"], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise KernelUnavailable(f"linking the CPU kernels failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target


@functools.cache
def library_path() -> Path:
    """The built library's path (building it if needed); its name is unique to the source,
    the compiler and this CPU's flags.

    Raises:
        KernelUnavailable: As load().
    """
    if read_flag(DISABLE_ENV):
        raise KernelUnavailable(f"disabled by {DISABLE_ENV}")
    return _build(_compiler())


_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
_DECLARATION = re.compile(r"^(void|int|int64_t|float)\s+(\w+)\s*\(([^)]*)\)\s*;", re.M)


def declarations(header: str) -> dict[str, tuple[list, object]]:
    """name -> (argtypes, restype) of every function the header declares (see csrc/pagoda_kernels.h
    for the form its declarations keep)."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    found = {}
    for result, name, params in _DECLARATION.findall(text):
        argtypes = []
        for param in params.split(","):
            param = " ".join(param.split())
            if param in ("", "void"):
                continue
            if "*" in param:
                argtypes.append(ctypes.c_void_p)
                continue
            base = param.replace("const ", "").rsplit(" ", 1)[0]
            if base not in _TYPES:
                raise KernelUnavailable(f"{HEADER.name}: {name}() has a parameter of type {base!r}, which the "
                                        "binding does not know")
            argtypes.append(_TYPES[base])
        found[name] = (argtypes, None if result == "void" else _TYPES[result])
    return found


class KernelLibrary:
    """The loaded library's declared functions as attributes (csrc/pagoda_kernels.h), each with its
    ctypes types; an undeclared name raises AttributeError."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        for name, (argtypes, restype) in declarations(HEADER.read_text()).items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise KernelUnavailable(f"{path.name} lacks {name}(), which {HEADER.name} declares") from None
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, fn)


@functools.cache
def load() -> KernelLibrary:
    """The kernel library, built if needed, its functions bound from csrc/pagoda_kernels.h.

    Raises:
        KernelUnavailable: Disabled, no compiler, the build failed, or the library lacks a
            declared function.
    """
    lib = KernelLibrary(library_path())
    lib.one_call_forward_set_exp16(_torch_exp16())
    return lib


@functools.cache
def _kernel(name: str):
    """A function of the library, looked up once (the attention and linear wrappers run per layer)."""
    return getattr(load(), name)


def _torch_exp16() -> int | None:
    """The address of the sixteen-lane exp torch's own vector kernels call on this CPU (SLEEF's,
    in libtorch_cpu), for csrc/one_call_forward.c's SiLU; None where torch's kernels are not the
    AVX-512 ones or the symbol is not there."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None
    try:
        fn = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).Sleef_expf16_u10
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def available() -> bool:
    """Whether the kernels can be used (building them now if needed). Where they cannot, a
    WARNING says why and what runs instead, once a process."""
    try:
        load()
    except (KernelUnavailable, OSError) as exc:
        logger.warning("Pagoda's CPU kernels are unavailable (%s): the matrix products run on torch's oneDNN "
                       "and attention on the torch_sdpa backend instead", exc)
        return False
    return True


