"""Digests of every kernel's machine code (its ELF `.text` section), to prove that a change of the CUDA sources
left the kernels as they were.

    python benchmarks/cubin_text.py FILE... > before.txt
    python benchmarks/cubin_text.py --against before.txt FILE...

FILE: a cubin (`nvcc -cubin`, which runs without a GPU), or a shared object whose cubins `cuobjdump -xelf all`
extracts (jaxbnn/_cuda*.so). One line per kernel: architecture, SHA-256 of its .text bytes (the first 16 hex
digits), size, and its demangled name with "(anonymous namespace)::" dropped, so that kernels moved between
translation units or namespaces compare by what they are. With --against, prints the kernels whose code
differs, or that are missing or new, and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from sass_calls import cubins, elf_sections  # noqa: E402


def kernel_digests(data: bytes) -> dict[str, tuple[str, int]]:
    """{mangled kernel name: (digest, size)} of one cubin."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    return {
        s["name"][len(".text.") :]: (hashlib.sha256(data[s["offset"] : s["offset"] + s["size"]]).hexdigest()[:16], s["size"])
        for s in elf_sections(data)
        if s["name"].startswith(".text.")
    }


def demangled(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return [line.replace("(anonymous namespace)::", "") for line in out.splitlines()]


def digest_lines(paths: list[str]) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        for arg in paths:
            for cubin in cubins(pathlib.Path(arg), pathlib.Path(scratch)):
                data = cubin.read_bytes()
                arch = f"sm_{(struct.unpack_from('<I', data, 0x30)[0] >> 8) & 0xFF}"
                kernels = kernel_digests(data)
                for name, (digest, size) in zip(demangled(list(kernels)), kernels.values()):
                    lines.append(f"{arch} {digest} {size:8d} {name}")
    return sorted(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("files", nargs="+", help="cubins or shared objects")
    parser.add_argument("--against", type=pathlib.Path, help="a listing written before: compare with it")
    args = parser.parse_args()
    lines = digest_lines(args.files)
    if args.against is None:
        print("\n".join(lines))
        return 0

    def by_kernel(rows: list[str]) -> dict[tuple[str, str], str]:
        return {(r.split()[0], r.split(None, 3)[3]): r.split()[1] for r in rows if r.strip()}

    before, after = by_kernel(args.against.read_text().splitlines()), by_kernel(lines)
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    missing, new = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
    for label, keys in (("changed", changed), ("missing", missing), ("new", new)):
        for arch, name in keys:
            print(f"{label}: {arch} {name}")
    same = len(before.keys() & after.keys()) - len(changed)
    print(f"{same} kernels identical, {len(changed)} changed, {len(missing)} missing, {len(new)} new")
    return 1 if changed or missing or new else 0


if __name__ == "__main__":
    sys.exit(main())
