"""The kernels' instruction sets (model/kernels/library.py, csrc/cpu.cpp): KVSERVE_ISA caps them in a
new process, a level the CPU lacks or an unknown one is an error, the path of each weight type follows
the cap, and only the code named for a wider instruction set than AVX2 holds its instructions, so the
AVX2 path forced on a wide CPU runs what an AVX2-only CPU runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from model import kernels
from model.kernels.build import library_path
from model.kernels.interface import FEATURE_AVX512BF16, ISAS
from model.kernels.library import configured_isa, handle
from tests.conftest import CPU_ISAS, forced_isa, needs_exact

pytestmark = needs_exact
WIDE_NAMESPACES = ("avx512", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx")  # csrc/epilogue.h


def run_with_isa(level: str) -> subprocess.CompletedProcess:
    """A new process with KVSERVE_ISA=level that prints the level in force and each weight type's path."""
    code = "import json; from model import kernels; print(json.dumps([kernels.isa(), kernels.kernel_paths()]))"
    env = {**os.environ, "KVSERVE_ISA": level}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def expected_paths(level: str) -> dict[str, str]:
    rank = list(ISAS).index
    wide = rank(level) >= rank("avx512")
    bf16 = rank(level) >= rank("avx512-vnni") and handle().kv_cpu_features() & FEATURE_AVX512BF16
    if rank(level) >= rank("avx512-vnni"):
        int8 = "amx" if level == "amx" else "avx512-vnni"
    else:
        int8 = "avx-vnni" if "avx-vnni" in CPU_ISAS and rank(level) >= rank("avx-vnni") else "avx2"
    return {
        "float32": "avx512" if wide else "avx2",
        "bfloat16": "avx512-bf16" if bf16 else "avx512" if wide else "avx2",
        "int8": int8,
    }


def test_the_environment_variable_caps_the_kernels_in_a_new_process():
    done = run_with_isa("avx2")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["avx2", {"float32": "avx2", "bfloat16": "avx2", "int8": "avx2"}]


def test_a_level_the_cpu_lacks_is_an_error_naming_what_it_has():
    lacking = [level for level in ISAS if level not in CPU_ISAS]
    if not lacking:
        pytest.skip("this CPU has every level")
    done = run_with_isa(lacking[-1])
    assert done.returncode != 0
    assert f"KVSERVE_ISA={lacking[-1]}: this CPU lacks" in done.stderr
    assert f"it has {', '.join(CPU_ISAS)}" in done.stderr
    with pytest.raises(RuntimeError, match="this CPU lacks"):
        kernels.set_isa(lacking[-1])
    assert kernels.isa() == CPU_ISAS[-1] or configured_isa() != "auto"  # the cap stays where it was


def test_an_unknown_level_is_a_value_error():
    with pytest.raises(ValueError, match="must be one of auto, avx2, avx-vnni, avx512, avx512-vnni, amx"):
        kernels.set_isa("avx1024")


def test_auto_is_the_cpus_highest_level():
    with forced_isa("avx2"):
        kernels.set_isa("auto")
        assert kernels.isa() == CPU_ISAS[-1]


@pytest.mark.parametrize("level", CPU_ISAS)
def test_each_weight_types_path_follows_the_cap(level):
    with forced_isa(level):
        assert kernels.isa() == level
        assert kernels.kernel_paths() == expected_paths(level)


def wide_instructions(disassembly: str) -> dict[str, set[str]]:
    """Function name -> the kinds of instruction wider than AVX2 it holds: registers only AVX-512 has
    (zmm, ymm16-31, opmasks), vpdpbusd in any encoding, AMX tiles."""
    found: dict[str, set[str]] = {}
    function = None
    for line in disassembly.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            continue
        if function is None or "\t" not in line:
            continue
        instruction = line.rsplit("\t", 1)[-1]
        kinds = set()
        if re.search(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b", instruction):
            kinds.add("avx512")
        if re.match(r"(\{vex\} )?vpdpbusd", instruction):
            kinds.add("vnni")
        if re.search(r"%tmm|tilecfg", instruction):
            kinds.add("amx")
        if kinds:
            found.setdefault(function, set()).update(kinds)
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to disassemble the library with")
def test_only_the_code_named_for_a_wider_instruction_set_holds_its_instructions():
    """The library is compiled for x86-64-v3 and its wider paths carry target attributes; an inline helper
    compiled for a wider set and shared with the AVX2 code would let the AVX2 path fault on an AVX2 CPU."""
    done = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", str(library_path())], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    found = wide_instructions(done.stdout)
    named = re.compile(r"\bkv::(?:\(anonymous namespace\)::)?(" + "|".join(WIDE_NAMESPACES) + r")::")
    stray = {function: kinds for function, kinds in found.items() if not named.search(function)}
    assert not stray, f"wider instructions outside {WIDE_NAMESPACES}: {stray}"
    kinds = set().union(*found.values())
    assert {"avx512", "vnni", "amx"} <= kinds, f"the wide paths are missing from the build: {kinds}"
