"""The hottest instructions of an ncu source export, with their stall reasons; or two exports compared.

    python benchmarks/ncu_hotspots.py CASE.sass.csv [--top 30]
    python benchmarks/ncu_hotspots.py BEFORE.sass.csv AFTER.sass.csv

Input: `ncu -i REPORT --page source --csv --print-source sass` (gpu_job.sh's ncu-cases step writes one
per case). One export: totals of warp-stall samples by reason, then the instructions with the most
samples (address, samples, times executed by warps, SASS, top two reasons). Two exports: each one's
totals side by side, to see which stall reasons a change moved (a new spill shows as long-scoreboard
stalls on local loads).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter


def load(path):
    rows = list(csv.reader(open(path)))
    header_at = next(i for i, r in enumerate(rows[:10]) if "Address" in r)
    header, data = rows[header_at], rows[header_at + 1:]
    # an export may list the kernel's code more than once, each copy under its own "Kernel Name" row
    data = data[:next((i for i, r in enumerate(data) if r[:1] == ["Kernel Name"]), len(data))]
    reasons = [h for h in header if h.startswith("stall_") and "(" not in h]
    col = {h: header.index(h) for h in header}
    records = []
    for r in data:
        stalls = Counter({h[len("stall_"):]: int(r[col[h]] or 0) for h in reasons})
        records.append({
            "address": r[col["Address"]][-6:],
            "source": r[col["Source"]].strip(),
            "samples": int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
            "executed": int(r[col["Instructions Executed"]] or 0),
            "stalls": stalls,
        })
    return records


def totals(records):
    out = Counter()
    for r in records:
        out.update(r["stalls"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+", help="one or two `--page source --csv` files")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    loaded = [load(p) for p in args.exports[:2]]
    for path, records in zip(args.exports, loaded):
        print(f"{path}: {sum(r['samples'] for r in records):,} samples, "
              f"{sum(r['executed'] for r in records):,} warp instructions executed")
    if len(loaded) == 2:
        before, after = totals(loaded[0]), totals(loaded[1])
        print(f"{'stall reason':20s} {'first':>9s} {'second':>9s} {'change':>9s}")
        for reason in sorted(set(before) | set(after), key=lambda k: -(after[k] - before[k])):
            if before[reason] or after[reason]:
                print(f"{reason:20s} {before[reason]:9,d} {after[reason]:9,d} {after[reason] - before[reason]:+9,d}")
        return
    records = loaded[0]
    print("by reason: " + ", ".join(f"{k} {v:,}" for k, v in totals(records).most_common(10) if v))
    for r in sorted(records, key=lambda r: -r["samples"])[:args.top]:
        top = ", ".join(f"{k} {v}" for k, v in r["stalls"].most_common(2) if v)
        print(f"{r['address']} {r['samples']:7,d} {r['executed']:10,d}  {r['source'][:60]:60s} {top}")


if __name__ == "__main__":
    main()
