"""Eager calls of the ops (outside `jax.jit`, as the README shows them) cost what a cached jitted call
costs: after the first call of a signature nothing is traced or compiled again and memory stays flat."""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn import formats, ops


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class CompileEvents:
    """Counts jax's tracing / lowering / compilation events while it is active."""

    NAMES = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.counts = collections.Counter()

    def _listen(self, name, seconds, **kwargs):
        if name in self.NAMES:
            self.counts[name] += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def test_eager_ops_neither_recompile_nor_grow_memory():
    rng = np.random.default_rng(0)
    a = ops.pack_bits(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32))
    dense = formats.pack_dense_weights(rng.standard_normal((64, 16)).astype(np.float32))
    x = ops.pack_bits(jnp.asarray(rng.standard_normal((1, 6, 6, 40)), jnp.float32))
    conv = formats.pack_conv_weights(rng.standard_normal((3, 3, 40, 8)).astype(np.float32))
    threshold = np.arange(16, dtype=np.int32) - 8

    def calls():
        ops.bmm(a, dense).block_until_ready()
        ops.bmm(a, dense, threshold=threshold).block_until_ready()
        ops.bconv2d(x, conv, pool=(2, 2)).block_until_ready()
        ops.pack_bits(np.ones((4, 40), np.float32)).block_until_ready()

    for _ in range(20):  # warm-up: the first call of each signature compiles
        calls()
    before = rss_mib()
    with CompileEvents() as events:
        for _ in range(300):
            calls()
    grown = rss_mib() - before
    assert not events.counts, f"eager calls traced or compiled again: {dict(events.counts)}"
    # An op that traced and compiled per eager call kept ~1.5 MiB a call (1,200 calls: ~1.8 GiB); what
    # remains here is allocator noise.
    assert grown < 40, f"RSS grew {grown:.1f} MiB over 1,200 eager calls"
