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
