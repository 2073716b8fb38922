"""Which subroutines the kernels' SASS calls, per architecture and kernel, from the cubins' ELF.

    python benchmarks/sass_calls.py FILE...

FILE: a cubin, or a shared object whose cubins `cuobjdump -xelf all` extracts (jaxbnn/_cuda*.so). The SASS step
of gpu_job.sh counts `CALL` lines; this names their targets, so an emulation subroutine (a tensor-core op or
popcount done in software) cannot hide among the compiler's own helpers. Counts CALL.REL / CALL.ABS
instructions (opcode bits 0-11 of each 16-byte sm_70+ instruction: 0x944 / 0x943) in each kernel's .text
section and lists the non-kernel functions ptxas placed there (its `$__internal_N_$__cuda_*` subroutines).
No disassembler needed: runs on a cubin compiled here (`nvcc -cubin`).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import shutil
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ptxas_report import short_name  # noqa: E402

CALL_OPCODES = (0x944, 0x943)  # CALL.REL (.NOINC), CALL.ABS
SHT_SYMTAB, STT_FUNC = 2, 2


def elf_sections(data: bytes) -> list[dict]:
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    sections = []
    for i in range(count):
        name, kind, _, _, offset, size, link, _, _, _ = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize)
        sections.append({"name_at": name, "kind": kind, "offset": offset, "size": size, "link": link})
    names = sections[names_index]
    for s in sections:
        s["name"] = c_string(data, names["offset"] + s["name_at"])
    return sections


def c_string(data: bytes, at: int) -> str:
    return data[at : data.index(b"\0", at)].decode()


def cubin_calls(data: bytes) -> dict[str, tuple[int, list[str]]]:
    """{kernel: (CALL instructions, subroutines in its section)} for one cubin."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    sections = elf_sections(data)
    symtab = next(s for s in sections if s["kind"] == SHT_SYMTAB)
    strings = sections[symtab["link"]]
    subroutines = collections.defaultdict(list)
    for i in range(symtab["size"] // 24):
        name_at, info, _, section, _, _ = struct.unpack_from("<IBBHQQ", data, symtab["offset"] + i * 24)
        name = c_string(data, strings["offset"] + name_at)
        if info & 0xF == STT_FUNC and sections[section]["name"] != ".text." + name:
            # ptxas numbers its helpers per cubin ($__internal_3_$__cuda_sm20_div_s64): keep the helper's name
            subroutines[section].append(re.sub(r"^\$__internal_\d+_\$", "", name))
    result = {}
    for index, s in enumerate(sections):
        if not s["name"].startswith(".text."):
            continue
        calls = sum(
            struct.unpack_from("<Q", data, s["offset"] + at)[0] & 0xFFF in CALL_OPCODES for at in range(0, s["size"], 16)
        )
        result[s["name"][len(".text.") :]] = (calls, sorted(subroutines[index]))
    return result


def cubins(path: pathlib.Path, scratch: pathlib.Path) -> list[pathlib.Path]:
    if path.suffix == ".cubin":
        return [path]
    subprocess.run(["cuobjdump", "-xelf", "all", str(path.resolve())], cwd=scratch, check=True, capture_output=True)
    return sorted(scratch.glob("*.cubin"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="FILE", help="a cubin, or a shared object holding cubins")
    args = parser.parse_args()
    for arg in args.files:
        if not pathlib.Path(arg).is_file():
            parser.error(f"no such file: {arg}")
        if not arg.endswith(".cubin") and shutil.which("cuobjdump") is None:
            parser.error(f"{arg}: extracting its cubins needs cuobjdump (the CUDA toolkit) on the PATH")
    total = 0
    with tempfile.TemporaryDirectory() as scratch:
        for arg in args.files:
            for cubin in cubins(pathlib.Path(arg), pathlib.Path(scratch)):
                arch = re.search(r"sm_\d+a?", cubin.name)
                kernels = cubin_calls(cubin.read_bytes())
                calls = sum(c for c, _ in kernels.values())
                helpers = collections.Counter(h for _, hs in kernels.values() for h in hs)
                total += calls
                print(f"{arch.group(0) if arch else cubin.name}: {calls} CALLs in {len(kernels)} kernels; "
                      f"subroutines: {', '.join(f'{h} x{n}' for h, n in sorted(helpers.items())) or 'none'}")
                for kernel, (count, hs) in sorted(kernels.items()):
                    if count or hs:
                        print(f"  {count:4d} {short_name(kernel)}: {', '.join(hs) or '-'}")
    print(f"CALLs in all: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
