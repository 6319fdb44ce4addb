"""The CPU kernels in csrc/ (paged attention, the bfloat16 and quantized linear layers), built on first use
with the machine's C compiler into one library.

The library is compiled for this CPU (``-march=native``; ``PAGODA_CPU_MARCH=x86-64-v3``
builds the AVX2 paths instead, to test them on an AVX-512 machine) and cached under
``$PAGODA_CACHE_DIR/kernels`` (default ``~/.cache/pagoda/kernels``), keyed by the
source, the compiler and the CPU's feature flags; later starts load it in milliseconds.
Without a C compiler (or with ``PAGODA_DISABLE_CPU_KERNELS=1``) nothing is built and
the backends that want the kernels are reported unavailable.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# fp8 caches: the kernels decode a byte through float16 bits, which for e4m3 are worth 2^-8 of
# its value (csrc/paged_attention.c); the factor goes into the scales.
_FP8_SUFFIX = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FP8_FACTOR = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (_CSRC / "paged_attention.c", _CSRC / "packed_linear.c", _CSRC / "tile_attention.c",
           _CSRC / "quant_linear.c", _CSRC / "one_call_forward.c")
HEADERS = (_CSRC / "vector_exp.h", _CSRC / "vector_lanes.h", _CSRC / "amx_tiles.h")
DISABLE_ENV = "PAGODA_DISABLE_CPU_KERNELS"
# NOTE: never -ffast-math: linking with it turns on flush-to-zero for the whole process
# (crtfastmath), which changes every float result in it. These are the parts of it that
# let the compiler vectorize the generic path's sums, without that side effect.
_FLAGS = ["-O3", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-fopenmp", "-shared", "-fPIC"]
MARCH_ENV = "PAGODA_CPU_MARCH"


def _flags() -> list[str]:
    """The compiler flags: the tuning above, for this CPU or the one MARCH_ENV names."""
    return [f"-march={os.environ.get(MARCH_ENV) or 'native'}", *_FLAGS]


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here."""


def _cache_dir() -> Path:
    env = os.environ.get("PAGODA_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda"
    return root / "kernels"


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
    logger.info("building the CPU kernels with %s (once per machine and source version)", compiler)
    start = time.perf_counter()
    try:
        result = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                text=True)
        if result.returncode != 0:
            names = ", ".join(source.name for source in SOURCES)
            raise KernelUnavailable(f"compiling {names} failed:\n{result.stderr.strip()}")
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
    if os.environ.get(DISABLE_ENV):
        raise KernelUnavailable(f"disabled by {DISABLE_ENV}")
    return _build(_compiler())


@functools.cache
def load() -> ctypes.CDLL:
    """The kernel library, built if needed.

    Raises:
        KernelUnavailable: Disabled, no compiler, or the build failed.
    """
    lib = ctypes.CDLL(str(library_path()))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    for query in _SUFFIX.values():
        for cache in ("", *(f"_{suffix}" for suffix in _FP8_SUFFIX.values())):
            fn = getattr(lib, f"paged_attention_{query}{cache}")
            fn.argtypes = [pointer, pointer, pointer, pointer, i64, pointer, pointer, pointer, pointer, pointer, i64,
                           i64, i64, i64, i64, ctypes.c_float, ctypes.c_float]
            fn.restype = None
    for name in ("paged_write_kv_bf16", "paged_write_kv_f32", "paged_write_kv_u8"):
        fn = getattr(lib, name)
        fn.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64, i64]
        fn.restype = None
    lib.packed_linear_bf16.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, pointer, i64, i64, i64]
    lib.packed_linear_bf16.restype = None
    lib.packed_silu_mul_linear_bf16.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, i64, i64]
    lib.packed_silu_mul_linear_bf16.restype = None
    for dtype in ("bf16", "f32"):
        shared, prefill = getattr(lib, f"shared_prefix_attention_{dtype}"), getattr(lib, f"prefill_attention_{dtype}")
        shared.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64, pointer, i64, pointer, i64, i64, i64,
                           ctypes.c_float, pointer, pointer, pointer, ctypes.c_int]
        prefill.argtypes = [pointer, pointer, pointer, pointer, i64, pointer, pointer, pointer, i64, i64, i64, i64, i64,
                            ctypes.c_float, pointer, ctypes.c_int]
        shared.restype = prefill.restype = ctypes.c_int
    lib.quant_linear.argtypes = [pointer, i64, i64, ctypes.c_int, i64, pointer, ctypes.c_int, ctypes.c_int, i64,
                                 pointer, pointer, i64, ctypes.c_int, i64]
    lib.quant_linear.restype = ctypes.c_int
    lib.quant_linear_argmax.argtypes = [pointer, i64, i64, ctypes.c_int, i64, pointer, ctypes.c_int, ctypes.c_int,
                                        i64, pointer, pointer, i64]
    lib.quant_linear_argmax.restype = ctypes.c_int
    lib.one_call_forward.argtypes = [pointer, i64, i64, pointer, pointer, pointer, pointer, pointer, i64, pointer,
                                     pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64, i64, i64, i64,
                                     ctypes.c_float, ctypes.c_float, pointer, i64, pointer, pointer, pointer, pointer,
                                     ctypes.c_int, i64, pointer, pointer, i64, pointer]
    lib.one_call_forward.restype = ctypes.c_int
    lib.quant_group_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.quant_group_bytes.restype = i64
    for name in ("packed_linear_available", "amx_probe", "quant_linear_vnni", "quant_linear_vector",
                 "tile_attention_vector_available", "tile_attention_float_available"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_int
    lib.quant_silu_mul_linear.argtypes = [pointer, i64, i64, i64, pointer, ctypes.c_int, ctypes.c_int, i64, pointer,
                                          i64, pointer]
    lib.quant_silu_mul_linear.restype = ctypes.c_int
    lib.silu_mul_bf16.argtypes = [pointer, i64, i64, pointer]
    lib.silu_mul_bf16.restype = None
    lib.one_call_forward_set_exp16.argtypes = [pointer]
    lib.one_call_forward_set_exp16.restype = ctypes.c_int
    lib.one_call_forward_set_exp16(_torch_exp16())
    return lib


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


def available() -> bool:
    """Whether the kernels can be used (building them now if needed)."""
    try:
        load()
    except (KernelUnavailable, OSError) as exc:
        logger.info("CPU kernels unavailable: %s", exc)
        return False
    return True


def supports(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIX


def supports_cache(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernels attend ``query_dtype`` queries over a ``cache_dtype`` cache: the
    query's own dtype, or fp8."""
    return query_dtype in _SUFFIX and (cache_dtype == query_dtype or cache_dtype in _FP8_SUFFIX)


@functools.cache
def _kernel(name: str):
    """A function of the library, looked up once (the attention and linear wrappers run per layer)."""
    return getattr(load(), name)


def write_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor) -> None:
    """Writes each token's key and value into its cache slot (a negative slot is skipped).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim] in the cache's dtype; views with any
            stride between tokens (as of a qkv product) are read in place.
        slot_mapping: int64 [num_tokens]: block_id * block_size + offset.
        key_cache: [num_blocks, num_kv_heads, head_dim, block_size] (keys transposed per block).
        value_cache: [num_blocks, num_kv_heads, block_size, head_dim].
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    key, value = _tokens_apart(key), _tokens_apart(value)
    assert slot_mapping.is_contiguous()
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype and slot_mapping.dtype == torch.int64
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    # NOTE: an fp8 cache takes the bytes of keys and values already converted.
    fn = _kernel("paged_write_kv_" + ("u8" if key_cache.dtype in _FP8_SUFFIX else _SUFFIX[key_cache.dtype]))
    fn(key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
       num_tokens, num_kv_heads, head_dim, value_cache.shape[2], key.stride(0), value.stride(0))


def _tokens_apart(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] with each token's heads contiguous (a copy only where they are not)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, return_lse: bool = False,
                    skip: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every query row over its request's paged context.

    Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``, the last of its
    ``seq_lens[i]`` positions; a row at position p attends to keys 0..p. Decodes are
    requests with one row.

    Args:
        query: [num_tokens, num_heads, head_dim], contiguous.
        key_cache: [num_blocks, num_kv_heads, head_dim, block_size] (keys transposed per block),
            in the query's dtype or fp8 (scale 1).
        value_cache: [num_blocks, num_kv_heads, block_size, head_dim], as key_cache.
        block_tables: int32 [num_reqs, >= max blocks], rows contiguous (a view that starts
            some blocks in attends over the keys from there on: positions count from it).
        seq_lens: int32 [num_reqs] context lengths (the step's tokens included).
        query_start_loc: int32 [num_reqs + 1].
        scale: Softmax scale.
        return_lse: Also return each row's log-sum-exp of its scaled scores (float32
            [num_tokens, num_heads]), to merge with attention over other keys.
        skip: None, or bool [num_reqs]: requests whose rows another kernel computes (their
            output rows are left unwritten).

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype (and the log-sum-exp).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size = key_cache.shape
    num_reqs = seq_lens.shape[0]
    assert query.is_contiguous() and block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    assert query_start_loc.is_contiguous() and query_start_loc.shape[0] == num_reqs + 1
    assert key_cache.dtype == value_cache.dtype and supports_cache(query.dtype, key_cache.dtype)
    factor = _FP8_FACTOR.get(key_cache.dtype)
    name = "paged_attention_" + _SUFFIX[query.dtype] + ("" if factor is None else "_" + _FP8_SUFFIX[key_cache.dtype])
    fn = _kernel(name)
    assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    out = torch.empty_like(query)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32) if return_lse else None
    if skip is not None:
        assert skip.dtype == torch.bool and skip.shape == (num_reqs,) and skip.is_contiguous()
    fn(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
       block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), out.data_ptr(),
       None if lse is None else lse.data_ptr(), None if skip is None else skip.data_ptr(), num_reqs, num_heads,
       num_kv_heads, head_dim, block_size, scale * (factor or 1.0), factor or 1.0)
    return (out, lse) if return_lse else out


def shared_prefix_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            blocks: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor,
                            scale: float, tiles: str, members: torch.Tensor | None = None,
                            query_start_loc: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every query row (or every row of the ``members``) against the keys of ``blocks`` (a
    prefix those requests share and all their rows come after), merged with each row's
    attention over its own keys, on ``tiles`` (attention_tiles(); csrc/tile_attention.c).

    Args:
        query: [num_tokens, num_heads, head_dim] bfloat16 (or float32, on "avx2" only),
            contiguous.
        key_cache, value_cache: As for paged_attention, in the query's dtype.
        blocks: int32 [n] the prefix's block ids.
        own_out, own_lse: paged_attention's output and log-sum-exp over each row's own keys.
        scale: Softmax scale.
        tiles: "amx", "avx512_bf16" or "avx2".
        members: None (every request), or int32 [n] the requests whose rows share the prefix
            (the others' rows are left unwritten); with query_start_loc (int32 [num_reqs + 1]).
        out: Where to write (a new tensor if None).

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype, or None where the kernel does
        not run (that kind of tiles not here or not for float32; head_dim not 64 or 128; no
        memory).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size = key_cache.shape
    assert query.dtype == key_cache.dtype == value_cache.dtype == own_out.dtype
    assert query.is_contiguous() and own_out.is_contiguous() and own_lse.is_contiguous()
    assert blocks.dtype == torch.int32 and blocks.is_contiguous() and own_lse.dtype == torch.float32
    if members is not None:
        assert members.dtype == query_start_loc.dtype == torch.int32
        assert members.is_contiguous() and query_start_loc.is_contiguous()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()
    failed = _kernel(f"shared_prefix_attention_{_TILE_DTYPES[query.dtype]}")(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), blocks.data_ptr(), blocks.shape[0],
        block_size, num_tokens, None if members is None else members.data_ptr(),
        0 if members is None else members.shape[0], None if members is None else query_start_loc.data_ptr(),
        num_heads, num_kv_heads, head_dim, scale, own_out.data_ptr(), own_lse.data_ptr(), out.data_ptr(),
        tiles_kind(tiles))
    return None if failed else out


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      requests: torch.Tensor, scale: float, out: torch.Tensor, tiles: str) -> bool:
    """The causal attention of the listed requests' query rows (prefill chunks) over their
    contexts, on ``tiles`` (attention_tiles(); csrc/tile_attention.c), written into their
    rows of ``out``.

    Args:
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc: As for
            paged_attention (bfloat16, or float32 on "avx2" only).
        requests: int32 [n] the requests to compute.
        scale: Softmax scale.
        out: [num_tokens, num_heads, head_dim] in the query's dtype, contiguous.
        tiles: "amx", "avx512_bf16" or "avx2".

    Returns:
        Whether it ran (False where the kernel does not: that kind of tiles not here or not
        for float32; head_dim not 64 or 128; no memory).
    """
    _, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size = key_cache.shape
    assert query.dtype == key_cache.dtype == value_cache.dtype == out.dtype
    assert query.is_contiguous() and out.is_contiguous() and block_tables.stride(1) == 1
    assert requests.dtype == torch.int32 and requests.is_contiguous()
    failed = _kernel(f"prefill_attention_{_TILE_DTYPES[query.dtype]}")(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), requests.data_ptr(),
        requests.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(), tiles_kind(tiles))
    return not failed


# The entry points' suffix per dtype (float32 runs on the "avx2" tiles alone).
_TILE_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}

# NOTE: in the order of tile_attention.c's `kind` argument.
TILE_KINDS = ("avx512_bf16", "amx", "avx2")


def tiles_kind(tiles: str) -> int:
    """tile_attention.c's `kind` argument for a kind of tiles."""
    if tiles not in TILE_KINDS:
        raise ValueError(f"tiles must be one of {TILE_KINDS}, not {tiles!r}")
    return TILE_KINDS.index(tiles)


@functools.cache
def attention_tile_kinds() -> tuple[str, ...]:
    """Every kind of tiles csrc/tile_attention.c runs here (prefill chunks and a shared prefix:
    many query rows against one set of keys), the faster first: "amx" where AMX tiles run,
    "avx512_bf16" where the library was built for AVX512-BF16 (its dot products on 16 rows in
    vector registers), "avx2" where it was built for AVX2 with FMA (float32 products on
    operands widened once; in AVX-512 builds too, where the vector tiles come first, unmeasured
    against them). Cached: tests that want another answer patch attention_tiles(),
    not packed_linear_amx_available()."""
    if not available():
        return ()
    kinds = ("amx",) if packed_linear_amx_available() else ()
    kinds += ("avx512_bf16",) if load().tile_attention_vector_available() else ()
    return kinds + (("avx2",) if load().tile_attention_float_available() else ())


def attention_tiles() -> str | None:
    """The tiles the cpu_paged backend uses here (the first of attention_tile_kinds()), or None:
    the paged kernel takes every row. NOTE: not the float32 tiles on a CPU with AVX-512 (Intel
    Skylake-SP to Ice Lake, without AVX512-BF16): measured on AVX2-only CPUs alone, they stay a
    kind that the tests run there."""
    kinds = [kind for kind in attention_tile_kinds() if kind != "avx2" or "avx512f" not in cpu_flags().split()]
    return kinds[0] if kinds else None


# -- the bfloat16 linear layer (csrc/packed_linear.c) ---------------------------------------

PACKED_LINEAR_GROUP = 64


def packed_linear_available() -> bool:
    """Whether packed_linear runs here: the library loads and this CPU has AVX512-BF16."""
    return available() and bool(load().packed_linear_available())


@functools.cache
def packed_linear_amx_available() -> bool:
    """Whether packed_linear can run on AMX tiles here: the kernel was built with them and
    one tile product ran (in a forked child, so a CPU that lists AMX but faults on it
    costs nothing; see amx_probe in csrc/packed_linear.c)."""
    if not packed_linear_available():
        return False
    ok = bool(load().amx_probe())
    if not ok and " amx_bf16" in cpu_flags():
        logger.warning("this CPU lists amx_bf16 but a tile product did not run; the linear layers will not use AMX")
    return ok


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] bfloat16 weight in packed_linear's layout: [ceil(N/64), ceil(K/2), 64, 2],
    zero-padded (see csrc/packed_linear.c)."""
    n, k = weight.shape
    group = PACKED_LINEAR_GROUP
    padded = weight.new_zeros(-(-n // group) * group, -(-k // 2) * 2)
    padded[:n, :k] = weight
    return padded.view(-1, group, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_silu_mul_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [2I, K] bfloat16 weight (gate_proj's I rows, then up_proj's) in
    packed_silu_mul_linear's layout: the groups of pack_linear_weight, each holding 32 gate
    features and then the same 32 up features (zero beyond I)."""
    n, k = weight.shape
    half = PACKED_LINEAR_GROUP // 2
    chunks = -(-n // 2 // half)
    paired = weight.new_zeros(chunks, 2, half, k)
    for i, part in enumerate(weight.chunk(2)):
        padded = weight.new_zeros(chunks * half, k)
        padded[: part.shape[0]] = part
        paired[:, i] = padded.view(chunks, half, k)
    return pack_linear_weight(paired.view(-1, k))


def _check_linear_input(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    assert x.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous()
    assert weight.shape[1] == -(-x.shape[1] // 2) and weight.shape[0] * PACKED_LINEAR_GROUP >= out_features
    return x if x.stride(1) == 1 else x.contiguous()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  amx_min_rows: int = 0, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ W.T + bias for a 2-D bfloat16 x and a weight from pack_linear_weight.

    With ``amx_min_rows`` > 0, an x of at least that many rows is multiplied on AMX tiles
    (only pass it where packed_linear_amx_available(); the sums differ from the AVX512
    path's by rounding). ``out_dtype`` float32 returns the float32 sums unrounded (logits).

    Returns:
        [x rows, out_features] in out_dtype.
    """
    x = _check_linear_input(x, weight, out_features)
    m, k = x.shape
    if bias is not None:
        assert bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.shape == (out_features,)
    assert out_dtype in (torch.bfloat16, torch.float32)
    out = torch.empty(m, out_features, dtype=out_dtype)
    if m:
        _kernel("packed_linear_bf16")(x.data_ptr(), m, x.stride(0), weight.data_ptr(), out_features, k,
                                      None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                      amx_min_rows, int(out_dtype == torch.float32))
    return out


def packed_silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, intermediate_size: int,
                           amx_min_rows: int = 0) -> torch.Tensor:
    """SiLU(x @ G.T) * (x @ U.T) for a 2-D bfloat16 x and a weight from
    pack_silu_mul_weight(cat(G, U)); ``amx_min_rows`` as for packed_linear.

    Returns:
        [x rows, intermediate_size] bfloat16.
    """
    x = _check_linear_input(x, weight, 2 * intermediate_size)
    m, k = x.shape
    out = torch.empty(m, intermediate_size, dtype=torch.bfloat16)
    if m:
        _kernel("packed_silu_mul_linear_bf16")(x.data_ptr(), m, x.stride(0), weight.data_ptr(), intermediate_size,
                                               k, out.data_ptr(), intermediate_size, amx_min_rows)
    return out


# -- the quantized linear layer (csrc/quant_linear.c) ---------------------------------------

QUANT_GROUP = 32  # input features per scale
QUANT_BLOCK = 16  # output features per block of the packed layout


@functools.cache
def _quant_group_bytes(bits: int, has_min: bool) -> int:
    return _kernel("quant_group_bytes")(bits, int(has_min))


def quant_linear_vector() -> bool:
    """Whether the quantized kernel was built with vector instructions (AVX512-VNNI or AVX2),
    else it is the portable C loop, for correctness only."""
    return available() and bool(load().quant_linear_vector())


def quant_linear_vnni() -> bool:
    """Whether the quantized kernel was built with AVX512-VNNI (else AVX2 or its portable C loop)."""
    return available() and bool(load().quant_linear_vnni())


def _quant_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, bits: int,
                    has_min: bool) -> torch.Tensor:
    """Checks the quantized kernel's operands; returns x with its rows' elements contiguous."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == torch.uint8
    k = x.shape[1]
    assert k % QUANT_GROUP == 0 and weight.is_contiguous()
    assert weight.numel() == -(-out_features // QUANT_BLOCK) * (k // QUANT_GROUP) * _quant_group_bytes(bits, has_min)
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (out_features,)
    return x if x.stride(1) == 1 else x.contiguous()


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, bits: int,
                 has_min: bool, out_f32: bool = False, amx_min_rows: int = 0) -> torch.Tensor:
    """x @ W.T + bias for a 2-D bfloat16 or float32 x and a weight packed by
    engine/models/quantized.py (``bits`` 8 or 4, with or without minimums); bias float32.
    From ``amx_min_rows`` rows (0: never) of bfloat16 x without bias, on AMX tiles: pass it
    only where :func:`packed_linear_amx_available` (the tiles proved to run).

    Returns:
        [x rows, out_features] in x's dtype, or float32 with ``out_f32``.
    """
    x = _quant_operands(x, weight, bias, out_features, bits, has_min)
    m, k = x.shape
    out_f32 = out_f32 or x.dtype == torch.float32
    out = torch.empty(m, out_features, dtype=torch.float32 if out_f32 else x.dtype)
    if m and _kernel("quant_linear")(x.data_ptr(), m, x.stride(0), int(x.dtype == torch.float32), k,
                                     weight.data_ptr(), bits, int(has_min), out_features,
                                     None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                     int(out_f32), amx_min_rows):
        raise MemoryError("quant_linear: out of memory for the quantized activations")
    return out


def quant_silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, intermediate_size: int, bits: int, has_min: bool,
                          amx_min_rows: int = 0) -> torch.Tensor:
    """SiLU(gate) * up of a bfloat16 x's product with a quantized gate/up weight (gate's
    features, then up's): from ``amx_min_rows`` rows (0: never) on AMX tiles with the
    activation in the product's epilogue (pass it only where :func:`packed_linear_amx_available`);
    else quant_linear, then :func:`silu_mul`.

    Returns:
        bfloat16 [x rows, intermediate_size].
    """
    assert x.dtype == torch.bfloat16
    x = _quant_operands(x, weight, None, 2 * intermediate_size, bits, has_min)
    m, k = x.shape
    out = torch.empty(m, intermediate_size, dtype=torch.bfloat16)
    if m and _kernel("quant_silu_mul_linear")(x.data_ptr(), m, x.stride(0), k, weight.data_ptr(), bits, int(has_min),
                                              intermediate_size, out.data_ptr(), amx_min_rows, None):
        raise MemoryError("quant_silu_mul_linear: out of memory")
    return out


def quant_linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                        bits: int, has_min: bool, amx_min_rows: int = 0) -> torch.Tensor:
    """Each row's index of its largest output of ``quant_linear(..., out_f32=True)`` with the same
    ``amx_min_rows`` (the first on ties), without writing the outputs: greedy sampling's LM head.

    Returns:
        int64 [x rows].
    """
    x = _quant_operands(x, weight, bias, out_features, bits, has_min)
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)
    if m and _kernel("quant_linear_argmax")(x.data_ptr(), m, x.stride(0), int(x.dtype == torch.float32), k,
                                            weight.data_ptr(), bits, int(has_min), out_features,
                                            None if bias is None else bias.data_ptr(), ids.data_ptr(),
                                            amx_min_rows):
        raise MemoryError("quant_linear_argmax: out of memory for the quantized activations")
    return ids


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, rounded to bfloat16 once, from a bfloat16 [rows, 2 * intermediate] gate/up
    product, as csrc/one_call_forward.c computes it."""
    assert gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
    gate_up = gate_up.contiguous()
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, intermediate, dtype=torch.bfloat16)
    _kernel("silu_mul_bf16")(gate_up.data_ptr(), rows, intermediate, out.data_ptr())
    return out
