"""Registers, stack and spills of every CUDA kernel, per template instance.

    python benchmarks/ptxas_report.py [--arch sm_90a] [SOURCE_DIR]

Compiles each kernel family's source (SOURCE_DIR/kernels/*.cu; SOURCE_DIR is the CUDA sources' folder,
default xla_ffi/cuda, whose parent is the include root) to a cubin with `nvcc -Xptxas=-v` (no GPU needed; a
few minutes per architecture) and prints one line per kernel. At the wgmma kernels' register
budget, a change to code that one kernel instance never runs can still move its allocation into spills
(docs/design/decisions.md, "Register budget"): compare this report before and after any kernel change.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

ENTRY = re.compile(
    r"Compiling entry function '(?P<name>\S+)' for '(?P<arch>\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads.*?"
    r"Used (?P<regs>\d+) registers",
    re.S,
)


def short_name(mangled: str) -> str:
    """WgmmaKernel<kSwizzledRows>, ResidentWgmmaKernel<kTapRows, 256>, BandWgmmaKernel<16, 1, 0>,
    ClassicKernel<MmaSyncEngine<256,3,16>, 4> ... from the mangled name."""
    kernel = re.search(r"\d([A-Za-z]+Kernel)I", mangled)
    if not kernel:
        return mangled
    name, args = kernel.group(1), mangled[kernel.end():]
    if name != "ClassicKernel":
        layouts = ["kCoreMatrices", "kSwizzledRows", "kChunkSlabs", "kTapRows"]
        layout = re.match(r"LN\w*?ALayoutE(\d)E", args)
        ints = re.findall(r"L[ib](\d+)E", args if not layout else args[layout.end():])
        params = ([layouts[int(layout.group(1))]] if layout else []) + ints
        return f"{name}<{', '.join(params)}>"
    engine = re.search(r"(SimtEngine|MmaSyncEngine)(?:ILi(\d+)ELi(\d+)ELi(\d+)E)?E*Li(\d+)", mangled)
    if engine and engine.group(1) == "MmaSyncEngine":
        cols, stages, warps, vec = engine.group(2, 3, 4, 5)
        return f"ClassicKernel<MmaSyncEngine<{cols},{stages},{warps}>, {vec}>"
    return f"ClassicKernel<{engine.group(1)}, {engine.group(5)}>" if engine else "ClassicKernel"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source_dir", nargs="?", default="xla_ffi/cuda")
    parser.add_argument("--arch", default="sm_90a")
    args = parser.parse_args()
    source_dir = pathlib.Path(args.source_dir)
    sources = sorted((source_dir / "kernels").glob("*.cu"))
    if not sources:
        print(f"{source_dir}: no kernels/*.cu", file=sys.stderr)
        return 2
    compute = args.arch.replace("sm_", "compute_")
    print(f"{'kernel':48s} {'registers':>9s} {'stack B':>8s} {'spill st/ld B':>14s}")
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            cmd = ["nvcc", "-cubin", "-O3", "-std=c++17", f"-gencode=arch={compute},code={args.arch}", "-Xptxas=-v",
                   f"-I{source_dir.resolve().parent}", "-o", f"{tmp}/{source.stem}.cubin", str(source)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return done.returncode
            for m in ENTRY.finditer(done.stderr):
                spills = f"{m['stores']}/{m['loads']}"
                print(f"{short_name(m['name']):48s} {m['regs']:>9s} {m['stack']:>8s} {spills:>14s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
