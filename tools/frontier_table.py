"""The README's frontier table: how far the optimizer (minigist/optimize.py) takes the seven
ImageNet networks, from exact plans (nothing allocated or run).

    python tools/frontier_table.py                 # prints the markdown table
    python tools/frontier_table.py --gemm 75e9 --bandwidth 34e9   # a fixed cost model

Batch 64, ImageNet input sizes, static allocation, the SGD update fused into the backward pass
(train.py's default), the im2col engine, SSDC planned from the bundled densities
(models/densities/, 5% above the densest batch measured). Each cell is a footprint as a ratio
to `none` (every stash kept in fp32) under the same settings: the smallest plan lossless (fp32,
the lossless encodings, recomputation), with fp16 and with fp8-e4m3 allowed (--gist all), and
the smallest plan within 10%, 15% and 20% predicted step-time overhead, lossless and with fp16.
The cost model is FLOPs and bytes at the GEMM rate and memory bandwidth given, or measured on
this machine (one BLAS thread, as train.py's im2col default) when not given.
"""
import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gist_table import EXTRA, PAPER, densities  # noqa: E402
from minigist import blas  # noqa: E402
from minigist.costmodel import FlopModel, measure_rates  # noqa: E402
from minigist.optimize import Optimizer  # noqa: E402
from minigist.pipeline import Options  # noqa: E402

COLUMNS = ["lossless min", "lossless 10%", "lossless 15%", "lossless 20%", "fp16 min", "fp16 10%", "fp16 15%",
           "fp16 20%", "fp8 min"]


def cells(name, cost, columns):
    path = os.path.join(ROOT, "models", name + ".prototxt")
    options = Options(batch_size=64, update="fused", conv="im2col", densities=densities(name))
    row, started = {}, time.perf_counter()
    for label, dpr, lossy in (("lossless", "fp16", False), ("fp16", "fp16", True), ("fp8", "fp8-e4m3", True)):
        wanted = [c for c in columns if c.split()[0] == label]
        if not wanted:
            continue
        optimizer = Optimizer(path, options.replace(dpr=dpr), cost, lossy=lossy)
        for column in wanted:
            cap = column.split()[1]
            row[column] = optimizer.smallest() if cap == "min" else optimizer.within(float(cap[:-1]) / 100)
    row["none MiB"] = optimizer.baseline_footprint / 2**20
    row["seconds"] = time.perf_counter() - started
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm", type=float, help="GEMM rate, FLOP/s (default: measured)")
    parser.add_argument("--bandwidth", type=float, help="memory bandwidth, bytes/s (default: measured)")
    parser.add_argument("--models", nargs="*", default=PAPER + EXTRA)
    parser.add_argument("--columns", nargs="*", default=COLUMNS, help=f"a part of {', '.join(COLUMNS)}")
    args = parser.parse_args()
    if args.gemm is None or args.bandwidth is None:
        with blas.threads(1):
            gemm, bandwidth = measure_rates()
        args.gemm = args.gemm or gemm
        args.bandwidth = args.bandwidth or bandwidth
    cost = FlopModel(args.gemm, args.bandwidth)
    print(f"cost model: {cost.describe()}\n")
    columns = args.columns
    print("| network (batch 64) | none MiB | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    ratios = {}
    for name in args.models:
        row = cells(name, cost, columns)
        shown = []
        for column in columns:
            plan = row[column]
            if plan is None:
                shown.append("-")
                continue
            ratios.setdefault(column, {})[name] = plan.ratio
            shown.append(f"{plan.ratio:.2f}x ({100 * plan.predicted_overhead:.0f}%)")
        print(f"| {name} | {row['none MiB']:,.0f} | " + " | ".join(shown) + " |", flush=True)
        print(f"<!-- {name}: {row['seconds']:.0f} s -->", file=sys.stderr)
    print()
    for column in columns:
        paper = [ratios.get(column, {}).get(n) for n in PAPER]
        if all(v is not None for v in paper):
            print(f"{column}: paper's five networks average {sum(paper) / len(paper):.2f}x")


if __name__ == "__main__":
    main()
