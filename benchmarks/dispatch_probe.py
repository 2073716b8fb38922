"""How many calls a timed program needs before host dispatch stops limiting a small op through XLA.

    python benchmarks/dispatch_probe.py [SIZE]      (default 4096; run on the GPU machine)
    python benchmarks/dispatch_probe.py conv        (the per-call floor of a binary convolution)
    python benchmarks/dispatch_probe.py conv-trace [DIR]  (where the C = 128 forms' host time goes)

Times the packed-in -> packed-out BMM (wgmma engine) of SIZE^3 in jitted programs of 1, 4, 16 and 32 calls
on distinct inputs, in batches of 5, 50 and 400 programs queued back to back (median of 5 batches), and the
host time to dispatch one program: how many calls a timed program needs before host dispatch stops limiting
the op (gpu_bench's copies_for comes from it). Set XLA_FLAGS=--xla_gpu_enable_command_buffer= to compare
without XLA's command buffers.
`conv`: microseconds per call of the TCBNN sweep's C = O = 128 convolution (batch 16, 64x64, 3x3, the band
kernel, ~9 us in the harness) and of a tiny one (batch 1, 8x8, C = O = 128: almost no GPU work), 32 calls
per program as gpu_bench runs them (distinct inputs, every output a result of the program) and chained as
in a network (each output the next call's input: the intermediates are XLA's temporaries): where both
sizes take the same time per call, the host's per-call work, not the kernel, sets the pace.
Every line says how often our handlers ran per call (0 where XLA replayed its command buffer) and their
host time per run. `conv` also times a pure-Python loop before and after (the host's speed: on a shared
virtual machine it can move 2x within seconds, and a 32-output program's dispatch with it).
`conv-trace`: the same programs under jax.profiler.trace, then the host threads' scopes (jax, PjRt, XLA's
command buffers) by self time per program: where a program's host time goes.
"""

import argparse
import collections
import glob
import os
import re
import statistics
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

from jaxbnn import _ffi, formats  # noqa: F401  (_ffi registers the native targets)
from gpu_bench import bmm_call, conv_out, signs

CALLS = (1, 4, 16, 32)
PROGRAMS_PER_BATCH = (5, 50, 400)


def time_programs(fn, args, calls, programs):
    """(median seconds per call over 5 batches of `programs` programs queued back to back, host seconds to
    dispatch one program, our handlers' runs per call, their host seconds per run); fn runs `calls` calls.
    Where XLA replays a captured command buffer, a call runs no handler (jaxbnn._cuda.handler_stats)."""
    samples = []
    before = _cuda.handler_stats()
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(programs):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (programs * calls))
    t0 = time.perf_counter()
    for _ in range(programs):
        out = fn(*args)
    host = (time.perf_counter() - t0) / programs
    jax.block_until_ready(out)
    after = _cuda.handler_stats()
    runs = after["calls"] - before["calls"]
    handler_host = (after["host_seconds"] - before["host_seconds"]) / runs if runs else 0.0
    return statistics.median(samples), host, runs / (6 * programs * calls), handler_host


def report(host, handler_runs, handler_host):
    return (f"host dispatch {host * 1e6:7.1f} us per program; handlers ran {handler_runs:.2f} times per call, "
            f"{handler_host * 1e6:5.2f} us each")


def main(s: int):
    ops = 2.0 * s**3
    keys = jax.random.split(jax.random.PRNGKey(0), max(CALLS) + 1)
    w = formats.pack_dense_weights(signs(keys[0], (s, s)))
    packed = [formats.pack_bits(signs(k, (s, s)) >= 0) for k in keys[1:]]
    thr, flip = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.uint8)
    attrs = dict(k=np.int64(s), n=np.int64(s))
    _cuda.set_kernel_path("wgmma")
    for calls in CALLS:
        fn = jax.jit(lambda wb, wp, t_, f_, *a: [bmm_call("bits", s, s, s)(x, wb, wp, t_, f_, **attrs) for x in a])
        args = [w.bits, w.popcount, thr, flip, *packed[:calls]]
        jax.block_until_ready(fn(*args))
        for programs in PROGRAMS_PER_BATCH:
            timing = time_programs(fn, args, calls, programs)
            print(f"{s}^3, {calls:2d} calls per program, {programs:3d} programs per batch: "
                  f"{ops / timing[0] / 1e12:8.1f} TOPS; {report(*timing[1:])}", flush=True)


def host_speed_ms():
    """Milliseconds of a fixed pure-Python loop (300,000 dict updates): the host thread's speed."""
    t0 = time.perf_counter()
    counts = {}
    for i in range(300_000):
        counts[i % 1000] = counts.get(i % 1000, 0) + i
    return (time.perf_counter() - t0) * 1e3


def conv_programs(batch, hw, calls):
    """The C = O = 128 3x3 convolution's timed forms: {form: (jitted program, its arguments)}: ours with
    distinct inputs and every output returned (gpu_bench's packed row), ours chained as in a network (each
    output the next call's input, one output returned), and XLA bf16 in the packed row's form."""
    c = o = 128
    keys = jax.random.split(jax.random.PRNGKey(1), calls + 1)
    wf = signs(keys[0], (3, 3, c, o))
    w = formats.pack_conv_weights(wf)
    xs = [signs(k, (batch, hw, hw, c), jnp.bfloat16) for k in keys[1:]]
    packed = [formats.pack_bits(x >= 0) for x in xs]
    thr, flip = jnp.zeros((o,), jnp.int32), jnp.zeros((o,), jnp.uint8)
    i64 = np.int64
    attrs = dict(c=i64(c), o=i64(o), kh=i64(3), kw=i64(3), stride_h=i64(1), stride_w=i64(1), pad_top=i64(1),
                 pad_bottom=i64(1), pad_left=i64(1), pad_right=i64(1), pad_one=False, pool_h=i64(1), pool_w=i64(1),
                 x_repeats=i64(1))
    oh = conv_out(hw, 3, 1)
    call = jax.ffi.ffi_call("jaxbnn_bconv2d_bits", jax.ShapeDtypeStruct((batch, oh, oh, formats.num_words(o)), jnp.uint32))

    def chained(wb, wp, t_, f_, x):
        for _ in range(calls):  # each call's packed output is the next one's input, as in a network
            x = call(x, wb, wp, t_, f_, **attrs)
        return x

    def xla_conv(x, w_):
        return jax.lax.conv_general_dilated(x, w_, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))

    weights = [w.bits, w.tap_popcount, thr, flip]
    return {
        "distinct inputs, every output returned": (
            jax.jit(lambda wb, wp, t_, f_, *a: [call(x, wb, wp, t_, f_, **attrs) for x in a]), [*weights, *packed]),
        "chained, one output returned": (jax.jit(chained), [*weights, packed[0]]),
        "XLA bf16, distinct inputs, every output returned": (
            jax.jit(lambda w_, *a: [xla_conv(x, w_) for x in a]), [wf.astype(jnp.bfloat16), *xs]),
    }


def conv_floor():
    calls, programs = 32, 50
    print(f"host speed: the Python loop took {host_speed_ms():.1f} ms", flush=True)
    for name, batch, hw in (("tcbnn C=O=128", 16, 64), ("tiny 8x8 C=O=128", 1, 8)):
        for form, (fn, args) in conv_programs(batch, hw, calls).items():
            if form.startswith("XLA"):
                continue
            jax.block_until_ready(fn(*args))
            timing = time_programs(fn, args, calls, programs)
            print(f"{name}, {form}: {timing[0] * 1e6:6.2f} us per call ({calls} calls per program, {programs} "
                  f"programs per batch); {report(*timing[1:])}; ran {_cuda.last_kernel_path()}", flush=True)
    print(f"host speed: the Python loop took {host_speed_ms():.1f} ms", flush=True)


def self_times(events):
    """{name: (inclusive ns, self ns, count)} of one thread's events, names without their instruction
    number (ffi_call.7 -> ffi_call); an event's self time excludes the events nested in it (TraceMe scopes
    on one thread nest or follow each other)."""
    totals = collections.defaultdict(lambda: [0, 0, 0])
    stack = []  # [end ns, name, nested ns, duration ns]

    def close(entry):
        _, name, children, duration = entry
        totals[name][1] += duration - children
        if stack:
            stack[-1][2] += duration

    for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        while stack and stack[-1][0] <= ev.start_ns:
            close(stack.pop())
        name = re.sub(r"\.\d+$", "", ev.name)
        totals[name][0] += ev.duration_ns
        totals[name][2] += 1
        stack.append([ev.start_ns + ev.duration_ns, name, 0, ev.duration_ns])
    while stack:
        close(stack.pop())
    return totals


def conv_trace(trace_dir, programs=50, shown=18):
    """Where the host time of each C = 128 form goes: `programs` programs queued back to back under
    jax.profiler.trace, then the host threads' TraceMe scopes (jax, PjRt, XLA's thunks and command
    buffers), by self time per program."""
    calls = 32
    print(f"host speed: the Python loop took {host_speed_ms():.1f} ms", flush=True)
    for form, (fn, args) in conv_programs(16, 64, calls).items():
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        out_dir = os.path.join(trace_dir, form.split(",")[0].replace(" ", "_"))
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # C++ scopes only: Python frames would add their own host time
        with jax.profiler.trace(out_dir, profiler_options=options):
            t0 = time.perf_counter()
            for _ in range(programs):
                out = fn(*args)
            host = (time.perf_counter() - t0) / programs
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t0) / programs
        path = sorted(glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True))[-1]
        plane = ProfileData.from_file(path).find_plane_with_name("/host:CPU")
        print(f"\n{form}: host dispatch {host * 1e6:.1f} us per program, {wall * 1e6:.1f} us per program "
              f"until the last finished (traced)", flush=True)
        for line in plane.lines:
            totals = self_times(line.events)
            busy = sum(v[1] for v in totals.values()) / programs / 1e3
            if busy < 1.0:
                continue
            print(f"  thread {line.name}: {busy:.1f} us per program in traced scopes; by self time:")
            for name, (incl, own, count) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:shown]:
                print(f"    {own / programs / 1e3:8.1f} us self {incl / programs / 1e3:8.1f} us incl "
                      f"{count / programs:6.1f} per program  {name[:110]}")
    print(f"host speed: the Python loop took {host_speed_ms():.1f} ms", flush=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="4096", help="SIZE, conv or conv-trace")
    parser.add_argument("trace_dir", nargs="?", default="/tmp/jaxbnn_conv_trace", help="conv-trace's folder")
    args = parser.parse_args()
    if args.what not in ("conv", "conv-trace") and not (args.what.isdigit() and int(args.what) > 0):
        parser.error(f"the first argument is a positive SIZE, conv or conv-trace, got {args.what!r}")
    if jax.devices()[0].platform != "gpu":
        parser.error("a GPU benchmark: jax's default device is " + jax.devices()[0].platform)
    return args


if __name__ == "__main__":
    arguments = _arguments()
    import jaxbnn._cuda as _cuda  # the module the probe reads its handlers' counters from: a GPU's only

    if arguments.what == "conv":
        conv_floor()
    elif arguments.what == "conv-trace":
        conv_trace(arguments.trace_dir)
    else:
        main(int(arguments.what))
