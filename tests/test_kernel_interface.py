"""The CPU kernels' interface, declared once (native/csrc/pagoda_kernels.h): the compiler holds every
definition to it, and the Python side binds every function's types from it."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from pagoda.native import library as kernel_library

needs_kernels = pytest.mark.skipif(not kernel_library.available(), reason="needs the CPU kernels (a C compiler)")


def test_every_source_includes_the_interface():
    for source in kernel_library.SOURCES:
        assert '#include "pagoda_kernels.h"' in source.read_text(), source.name


def test_the_declarations_parse_with_their_types():
    declared = kernel_library.declarations(kernel_library.HEADER.read_text())
    # Every prototype of the header is read (none skipped by the parser's form).
    text = kernel_library.HEADER.read_text()
    assert len(declared) == text.count(");") and len(declared) > 25
    argtypes, restype = declared["quant_linear"]
    assert restype is ctypes.c_int and len(argtypes) == 14
    assert argtypes[:4] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    assert declared["amx_probe"] == ([], ctypes.c_int)
    assert declared["packed_linear_bf16"][1] is None
    with pytest.raises(kernel_library.KernelUnavailable, match="short"):
        kernel_library.declarations("int odd(short x);")


@needs_kernels
def test_the_library_binds_what_is_declared_and_nothing_else():
    lib = kernel_library.load()
    for name, (argtypes, restype) in kernel_library.declarations(kernel_library.HEADER.read_text()).items():
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes and fn.restype == restype, name
    with pytest.raises(AttributeError):
        lib.request_of_row  # a function of the sources, not of the interface
    with pytest.raises(ctypes.ArgumentError):
        lib.quant_group_bytes(4, "not an int")
    with pytest.raises(TypeError):
        lib.quant_group_bytes(4)  # one argument short


@needs_kernels
def test_a_declared_function_the_library_lacks_fails_the_load(tmp_path, monkeypatch):
    header = tmp_path / "pagoda_kernels.h"
    header.write_text(kernel_library.HEADER.read_text() + "\nint pagoda_not_built(int64_t n);\n")
    monkeypatch.setattr(kernel_library, "HEADER", header)
    with pytest.raises(kernel_library.KernelUnavailable, match="lacks pagoda_not_built"):
        kernel_library.KernelLibrary(kernel_library.library_path())


def test_a_definition_that_drifts_from_the_interface_does_not_compile(tmp_path):
    source = tmp_path / "drift.c"
    source.write_text('#include "pagoda_kernels.h"\nint64_t quant_group_bytes(int bits, int64_t has_min) { return 0; }\n')
    result = subprocess.run([kernel_library._compiler(), f"-I{kernel_library.HEADER.parent}", "-c", "-o",
                             str(tmp_path / "drift.o"), str(source)], capture_output=True, text=True)
    assert result.returncode != 0 and "conflicting types" in result.stderr


def test_the_build_names_each_file_as_it_compiles_and_the_one_that_fails(tmp_path, monkeypatch, caplog):
    # A stand-in compiler (a shell script): every file "compiles" at once but tile_attention.c,
    # which fails with a message. The real build is the one every other test here loads.
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\n'
                        'case "$*" in *--version*) echo stand-in; exit 0;; esac\n'
                        'case "$*" in *tile_attention.c*) echo "tile_attention.c:1: error: broken" >&2; exit 1;; esac\n'
                        'while [ "$1" != "-o" ]; do shift; done; : > "$2"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_library, "_parallel_builds", lambda: 1)  # NOTE: one at a time: a fixed order
    caplog.set_level("INFO", logger=kernel_library.__name__)
    with pytest.raises(kernel_library.KernelUnavailable, match="compiling tile_attention.c failed:\n.*error: broken"):
        kernel_library._build(str(compiler))
    compiled = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("compiled ")]
    assert compiled == ["paged_attention.c", "packed_linear.c"], caplog.text
    assert any("building the CPU kernels with" in r.getMessage() and "5 files" in r.getMessage()
               for r in caplog.records)
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built is left to load
