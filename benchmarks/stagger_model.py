"""A two-warpgroup timing model of the wgmma kernel's consumers: cooperative against staggered.

    python benchmarks/stagger_model.py

Each consumer warpgroup runs per tile a k loop of `k_blocks` K blocks, then an epilogue of `epilogue_us`.
A K block of one warpgroup takes `block_us` of tensor time; when both warpgroups issue wgmmas they share
the tensor cores equally, so each goes at half speed. Cooperative (main): both start every tile together
and run their epilogues at the same time. Staggered: warpgroup 1 starts `lag` K blocks behind warpgroup 0
and they never meet again (one column tile); neither can lead the other by more than `stages` K blocks
(a stage is refilled only after both have read it). Ignores load latency, the producer and tile starts:
an upper bound on what the stagger can gain, for choosing the lag and writing predictions.
"""

from __future__ import annotations

BLOCK_US = 0.315  # one warpgroup's 64 x 256 x 1024 K block at the ~14 POPS ceiling of an H100


def cooperative(k_blocks, tiles, epilogue_us, block_us=BLOCK_US):
    return tiles * (2 * k_blocks * block_us + epilogue_us)


def staggered(k_blocks, tiles, epilogue_us, lag, block_us=BLOCK_US, stages=4, dt=0.001):
    # per warpgroup: [phase, time or work left, tiles done, K blocks done]
    state = [["k", k_blocks * block_us, 0, 0.0], ["k", k_blocks * block_us, 0, 0.0]]
    t, second_started = 0.0, False
    while min(s[2] for s in state) < tiles:
        issuing = [i for i in (0, 1) if state[i][0] == "k" and state[i][2] < tiles]
        if not second_started:
            second_started = state[0][3] >= lag
            if not second_started and 1 in issuing:
                issuing.remove(1)
        for i in list(issuing):
            other = state[1 - i]
            if state[i][3] - other[3] >= stages and other[2] < tiles:
                issuing.remove(i)
        share = 1.0 / len(issuing) if issuing else 0.0
        for i, s in enumerate(state):
            if s[2] >= tiles:
                continue
            if s[0] == "k" and i in issuing:
                s[1] -= dt * share
                s[3] += dt * share / block_us
                if s[1] <= 1e-9:
                    s[0], s[1] = "e", epilogue_us
            elif s[0] == "e":
                s[1] -= dt
                if s[1] <= 1e-9:
                    s[0], s[1], s[2] = "k", k_blocks * block_us, s[2] + 1
        t += dt
    return t


def main():
    cases = [("BConv C=128", 2, 4), ("BConv C=256", 3, 4), ("BConv C=512", 5, 8), ("BConv C=1024", 9, 8),
             ("BMM 4096^3", 4, 4), ("BMM 8192^3", 8, 16)]  # (name, K blocks, tiles per CTA)
    print(f"{'case':14s} {'epilogue us':>11s}  gain over cooperative at lag 1 / 2 / 3")
    for name, k_blocks, tiles in cases:
        for epilogue_us in (1.0, 1.5, 2.0):
            base = cooperative(k_blocks, tiles, epilogue_us)
            gains = [base / staggered(k_blocks, tiles, epilogue_us, lag) - 1 for lag in (1, 2, 3)]
            print(f"{name:14s} {epilogue_us:11.1f}  " + " / ".join(f"{g:+.0%}" for g in gains))


if __name__ == "__main__":
    main()
