"""The benchmark record: one markdown file per machine kind in benchmarks/results/, one section per benchmark.

    python benchmarks/results_file.py list PATH          # the sections of a results file
    python benchmarks/results_file.py merge SRC DEST     # SRC's sections replace DEST's (or are appended)

gpu_bench.py, cpu_bench.py and model_bench.py each own a section of their machine's file
(`benchmarks/results/<machine kind>.md`, e.g. nvidia-h200.md) and replace it whole on every run, so a file
always holds the latest run of each benchmark on that kind of machine. A section lies between the lines
`<!-- section: NAME -->` and `<!-- end: NAME -->` and starts with the run's header: machine, driver or ISA
tier, jax version, date, commit and the exact command. `merge` brings a run made elsewhere (a GPU job writes
into its own output folder) into the tree's file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import shlex
import subprocess
import sys

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
REPO_DIR = RESULTS_DIR.parent.parent
SECTION = re.compile(r"<!-- section: (?P<name>.+?) -->\n(?P<body>.*?)<!-- end: (?P=name) -->\n?", re.S)
# environment variables that change what a run measures: they are part of its command line
RELEVANT_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR", "CUDA_VISIBLE_DEVICES")


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_kind(device_kind: str) -> str:
    """The machine kind of a GPU, from jax's `device_kind` ('NVIDIA H200' -> 'nvidia-h200')."""
    return slug(device_kind)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown CPU"


def cpu_generation() -> str:
    """The CPU's family and model numbers ('family 26, model 2'), or '' where /proc/cpuinfo has none: a virtual
    machine's model name ('AMD EPYC') is the same for CPU generations whose speeds differ."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n", 1)[0].splitlines() if ":" in line)
    except OSError:
        return ""
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']}, model {fields['model']}"


def cpu_machine() -> str:
    """This CPU as the results name it: model name (family, model), cores, the kernels' tier."""
    generation = cpu_generation()
    return (f"{cpu_model()}{f' ({generation})' if generation else ''}, {os.cpu_count()} cores, "
            f"kernel tier {cpu_tier()}")


def cpu_tier() -> str:
    """The CPU kernels' instruction-set tier on this machine (jaxbnn's CPU module), or 'unknown'."""
    try:
        from jaxbnn import _cpu
    except ImportError:
        return "unknown"
    return _cpu.active_isa()


def cpu_kind() -> str:
    """The machine kind of this CPU: its model name without trademarks, speeds and core counts, and the
    cores this process sees ('AMD EPYC' on 2 cores -> 'cpu-amd-epyc-2core'); where the kernels' tier is below
    AVX-512, the tier too ('cpu-amd-epyc-2core-avx2'): a virtual machine's model name ('AMD EPYC') is the same
    for CPUs with and without AVX-512, whose kernels differ several times in speed."""
    name = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|@.*|\b\d+-core\b", " ", cpu_model().lower())
    tier = cpu_tier()
    suffix = "" if tier.startswith("avx512") else f"-{slug(tier)}"
    return f"cpu-{slug(name) or 'unknown'}-{os.cpu_count()}core{suffix}"


def default_path(kind: str) -> pathlib.Path:
    return RESULTS_DIR / f"{kind}.md"


def git_commit(paths: tuple[str, ...] = ()) -> str:
    """The short commit of the checkout, marked where `paths` (repository-relative) have uncommitted changes."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=REPO_DIR, capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    where = f" under {', '.join(paths)}" if paths else ""
    return commit + (f" (with uncommitted changes{where})" if dirty else "")


def device_machine(device) -> str:
    """A jax device as the results name it: a GPU's kind and, where jax knows it, its number of SMs; a CPU's
    model, cores and kernel tier."""
    if device.platform == "cpu":
        return cpu_machine()
    sms = getattr(device, "core_count", None)
    return f"{device.device_kind} ({sms} SMs)" if sms else device.device_kind


def device_kind(device) -> str:
    """The machine kind of a jax device: gpu_kind for a GPU, cpu_kind for the CPU."""
    return cpu_kind() if device.platform == "cpu" else gpu_kind(device.device_kind)


def gpu_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def device_driver(device) -> str | None:
    """The GPU driver's version for a GPU device; None (no driver line) for the CPU."""
    return None if device.platform == "cpu" else gpu_driver()


def command_line() -> str:
    """This process's command line as a shell would take it, with the environment that changes a run."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RELEVANT_ENV if os.environ.get(k)]
    return " ".join(env + ["python", shlex.join(sys.argv)])


def run_header(machine: str, commit: str, *, driver: str | None = None) -> list[str]:
    """The header lines every section starts with (markdown list items)."""
    import jax

    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"- machine: {machine}"]
    if driver is not None:
        lines.append(f"- driver: {driver}")
    lines += [
        f"- jax: {jax.__version__}",
        f"- date: {now:%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit or 'unknown'}",
        f"- command: `{command_line()}`",
    ]
    return lines


def gpu_run(parser, args) -> tuple[pathlib.Path, str, list[str]]:
    """A GPU benchmark's start: jax's default device (a parser error where it is no GPU), then the results
    file its section goes to (`args.out`, else the machine kind's), the machine and the run's header
    (`args.commit`, else the checkout's HEAD)."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        parser.error("a GPU benchmark: jax's default device is " + device.platform)
    out = pathlib.Path(args.out) if args.out else default_path(device_kind(device))
    machine = device_machine(device)
    return out, machine, run_header(machine, args.commit or git_commit(), driver=device_driver(device))


def sections(text: str) -> dict[str, str]:
    """{name: body} of a results file's sections, in file order."""
    return {m["name"]: m["body"] for m in SECTION.finditer(text)}


def _block(name: str, body: str) -> str:
    return f"<!-- section: {name} -->\n{body.rstrip()}\n<!-- end: {name} -->\n"


def _file_head(machine: str) -> str:
    return (
        f"# Benchmark results: {machine}\n\n"
        "The latest run of each benchmark on this kind of machine. Each section below is written whole by the\n"
        "script it names, with the run's machine, software, date, commit and command; `benchmarks/README.md`\n"
        "says what each benchmark measures and how to run it.\n\n"
    )


def replace_sections(text: str, new: dict[str, str]) -> str:
    """`text` with each section of `new` replaced in place, or appended where it has none."""
    done = set()

    def swap(m):
        if m["name"] not in new:
            return m.group(0)
        done.add(m["name"])
        return _block(m["name"], new[m["name"]])

    text = SECTION.sub(swap, text)
    for name, body in new.items():
        if name not in done:
            text = text.rstrip("\n") + "\n\n" + _block(name, body)
    return text


def write_section(path: str | os.PathLike, name: str, body: str, machine: str) -> None:
    """Replaces section `name` of the results file at `path` with `body` (appends it where the file has no
    such section; starts the file where there is none). Written atomically: a temporary file renamed over it."""
    path = pathlib.Path(path)
    text = path.read_text() if path.exists() else _file_head(machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(replace_sections(text, {name: body}))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the sections of a results file").add_argument("path", type=pathlib.Path)
    merge = commands.add_parser("merge", help="SRC's sections replace DEST's (or are appended)")
    merge.add_argument("src", type=pathlib.Path)
    merge.add_argument("dest", type=pathlib.Path)
    args = parser.parse_args(argv)
    source = args.path if args.command == "list" else args.src
    if not source.is_file():
        parser.error(f"no such results file: {source}")
    if args.command == "list":
        for name, body in sections(source.read_text()).items():
            date = re.search(r"^- date: (.*)$", body, re.M)
            print(f"{name}: {date.group(1) if date else 'no date'}")
        return 0
    new = sections(source.read_text())
    if not new:
        parser.error(f"{source}: no sections")
    text = args.dest.read_text() if args.dest.exists() else source.read_text().split("<!-- section:", 1)[0]
    tmp = args.dest.with_name(args.dest.name + ".tmp")
    tmp.write_text(replace_sections(text, new))
    os.replace(tmp, args.dest)
    print(f"{args.dest}: {', '.join(new)} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
