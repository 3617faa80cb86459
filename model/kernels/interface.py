"""The C interface as Python sees it, read from its one declaration, csrc/api.h: the constants of
its enums, the ctypes argument and result types of its functions, and ctypes mirrors of its structs.

Pure Python (no compiler needed), so the stock kernels can share the constants on a machine where
the library cannot be built.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "csrc" / "api.h"

_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _ctype(declaration: str, structs: dict[str, type] | None = None):
    """A ctypes type for one C declaration without its name ('const float*', 'int64_t', 'void')."""
    decl = declaration.replace("const", "").strip()
    if decl.endswith("*"):
        target = decl.rstrip("*").strip()
        if structs and target in structs and decl.count("*") == 1:
            return ctypes.POINTER(structs[target])
        return ctypes.c_void_p
    if decl == "void":
        return None
    if structs and decl in structs:
        return structs[decl]
    if decl not in _SCALARS:
        raise ValueError(f"{HEADER.name}: a type the interface parser does not know: {declaration!r}")
    return _SCALARS[decl]


def _split_declarator(declarator: str) -> tuple[str, str]:
    """'const float* ln_1' -> ('const float*', 'ln_1')."""
    m = re.fullmatch(r"(.*?[\s*])(\w+)", declarator.strip())
    if m is None:
        raise ValueError(f"{HEADER.name}: cannot read the declaration {declarator!r}")
    return m.group(1).strip(), m.group(2)


def _parse(text: str):
    text = _strip_comments(text)
    constants: dict[str, int] = {}
    for body in re.findall(r"enum\s*\{(.*?)\};", text, re.S):
        for entry in body.split(","):
            if entry.strip():
                name, value = entry.split("=")
                constants[name.strip()] = int(value.strip(), 0)
    structs: dict[str, type] = {}
    for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\};", text, re.S):
        fields = [_split_declarator(line) for line in body.split(";") if line.strip()]
        structs[name] = type(
            name, (ctypes.Structure,), {"_fields_": [(field, _ctype(ctype, structs)) for ctype, field in fields]}
        )
    functions = {}
    extern = text[text.index('extern "C"') :]
    for result, name, params in re.findall(r"([\w\s*]+?)\s*\b(kv_\w+)\(([^)]*)\);", extern):
        args = [_ctype(_split_declarator(p)[0], structs) for p in params.split(",") if p.strip()]
        functions[name] = (args, _ctype(result))
    return constants, structs, functions


CONSTANTS, STRUCTS, SIGNATURES = _parse(HEADER.read_text())

ABI_VERSION = CONSTANTS["KV_ABI_VERSION"]
EPILOGUE_NONE = CONSTANTS["KV_EPILOGUE_NONE"]
EPILOGUE_GELU = CONSTANTS["KV_EPILOGUE_GELU"]
EPILOGUE_RESIDUAL = CONSTANTS["KV_EPILOGUE_RESIDUAL"]
EPILOGUE_SILU_MUL = CONSTANTS["KV_EPILOGUE_SILU_MUL"]
NORM_LAYER = CONSTANTS["KV_NORM_LAYER"]
NORM_RMS = CONSTANTS["KV_NORM_RMS"]
DTYPE_F32 = CONSTANTS["KV_DTYPE_F32"]
DTYPE_BF16 = CONSTANTS["KV_DTYPE_BF16"]
DTYPE_BF16_F32 = CONSTANTS["KV_DTYPE_BF16_F32"]
DTYPE_I8 = CONSTANTS["KV_DTYPE_I8"]
INT8_CACHE_MAX_BLOCK = CONSTANTS["KV_INT8_CACHE_MAX_BLOCK"]
WEIGHT_F32 = CONSTANTS["KV_WEIGHT_F32"]
WEIGHT_BF16 = CONSTANTS["KV_WEIGHT_BF16"]
WEIGHT_INT8 = CONSTANTS["KV_WEIGHT_INT8"]
WEIGHT_BF16_PAIRS = CONSTANTS["KV_WEIGHT_BF16_PAIRS"]
FEATURE_AVX512F = CONSTANTS["KV_FEATURE_AVX512F"]
FEATURE_AVX512BF16 = CONSTANTS["KV_FEATURE_AVX512BF16"]
FEATURE_AVX512VNNI = CONSTANTS["KV_FEATURE_AVX512VNNI"]
FEATURE_AMX_INT8 = CONSTANTS["KV_FEATURE_AMX_INT8"]
FEATURE_AVX2 = CONSTANTS["KV_FEATURE_AVX2"]
FEATURE_AVX_VNNI = CONSTANTS["KV_FEATURE_AVX_VNNI"]


def _names(prefix: str) -> dict[str, int]:
    """An enum's constants by their names as users spell them: KV_ISA_AVX512_VNNI -> 'avx512-vnni'."""
    return {
        name.removeprefix(prefix).lower().replace("_", "-"): value
        for name, value in CONSTANTS.items()
        if name.startswith(prefix)
    }


ISAS = _names("KV_ISA_")  # the levels KVSERVE_ISA names, lowest first: avx2, avx-vnni, avx512, avx512-vnni, amx
PATHS = {value: name for name, value in _names("KV_PATH_").items()}  # KV_PATH_* -> avx2, ..., amx
