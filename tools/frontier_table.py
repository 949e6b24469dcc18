"""The README's frontier table: how far the optimizer (minigist/optimize.py) takes the seven
ImageNet networks, from exact plans (nothing allocated or run).

    python tools/frontier_table.py                 # prints the markdown table
    python tools/frontier_table.py --measure       # the cost model at this machine's rates

Batch 64, ImageNet input sizes, static allocation, the SGD update fused into the backward pass
(train.py's default), the im2col engine, SSDC planned from the bundled densities
(models/densities/, 5% above the densest batch measured). Each cell is a footprint as a ratio
to `none` (every stash kept in fp32) under the same settings, with its predicted overhead: the
smallest plan lossless (fp32, the lossless encodings, recomputation), with fp16 and with
fp8-e4m3 allowed (--gist all, smaller batch chunks too), and the smallest plan within 10%, 15%
and 20% predicted step-time overhead, lossless and with fp16 (a plan within a smaller cap counts
for the larger ones; the smallest plan of all is the best of every column). "bound" is the
ratio no plan can pass (Optimizer.floor: the most bytes one step needs whatever is chosen).
The cost model is FLOPs and bytes at the reference rates (costmodel.reference_model), or
measured on this machine (one BLAS thread, as train.py's im2col default) with --measure.
Each cell as it is found, and seconds per network, on stderr. `--microbatch vgg16=pool2:4`
plans VGG-16 with its front, the input through pool2, run 4 samples at a time (train.py
--microbatch), still against `none` with the front whole; `--microbatch auto` (every network)
or `vgg16=auto` lets the optimizer choose the front with each plan (train.py --microbatch
auto), and a cell names the front its plan runs.
`--update auto` lets it choose the SGD update, fused or blocked (a fully connected layer's weight
gradient made a block of rows at a time), still against `none` with the update fused; a cell
says where its plan's update is blocked.
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
from minigist.costmodel import FlopModel, measure_rates, reference_model  # noqa: E402
from minigist.optimize import optimizer_for  # noqa: E402
from minigist.pipeline import Options  # noqa: E402

COLUMNS = ["lossless bound", "lossless min", "lossless 10%", "lossless 15%", "lossless 20%", "fp16 bound",
           "fp16 min", "fp16 10%", "fp16 15%", "fp16 20%", "fp8 min"]


def cells(name, cost, columns, microbatch=(), update="fused", progress=None):
    """{column: (ratio, overhead or None, the plan's Options or None)} of one network (its
    front micro-batched where `microbatch` is (blob, samples), chosen per plan where it is
    "auto"; its SGD update `update`, chosen per plan between fused and blocked where it is
    "auto"), and its none footprint in bytes (the front whole, the update fused where auto).
    `progress(column, cell)` is called as each cell is found (the table prints only at a row's
    end, and a row can take an hour)."""
    path = os.path.join(ROOT, "models", name + ".prototxt")
    options = Options(batch_size=64, update="fused", conv="im2col", densities=densities(name))
    row, none = {}, None
    for label, dpr, lossy in (("lossless", "fp16", False), ("fp16", "fp16", True), ("fp8", "fp8-e4m3", True)):
        wanted = [c for c in columns if c.split()[0] == label]
        if not wanted:
            continue
        optimizer = optimizer_for(path, options.replace(dpr=dpr), cost, lossy=lossy, microbatch=microbatch,
                                  update=update)
        none = optimizer.baseline_footprint
        best = None     # a plan within a smaller cap is within a larger one: the caps in order
        for column in sorted(wanted, key=_order):
            kind = column.split()[1]
            if kind == "bound":
                row[column] = (none / optimizer.floor()[0], None, None)
            else:
                plan = optimizer.smallest() if kind == "min" else optimizer.within(float(kind[:-1]) / 100)
                if plan is not None and (best is None or plan.footprint_bytes < best.footprint_bytes):
                    best = plan
                row[column] = None if best is None else (best.ratio, best.predicted_overhead, best.options)
            if progress:
                progress(column, row[column])
    return row, none


def _order(column):
    """Bound first, then the caps from the smallest up, the smallest plan of all last."""
    kind = column.split()[1]
    return -1.0 if kind == "bound" else float("inf") if kind == "min" else float(kind[:-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure this machine's rates (default: reference)")
    parser.add_argument("--gemm", type=float, help="GEMM rate, FLOP/s")
    parser.add_argument("--bandwidth", type=float, help="memory bandwidth, bytes/s")
    parser.add_argument("--models", nargs="*", default=PAPER + EXTRA)
    parser.add_argument("--columns", nargs="*", default=COLUMNS, help="a part of " + ", ".join(COLUMNS).replace("%", "%%"))
    parser.add_argument("--microbatch", nargs="*", default=[], metavar="NETWORK=BLOB:SAMPLES|NETWORK=auto|auto",
                        help="run that network's front through BLOB SAMPLES samples at a time, or let the optimizer "
                             "choose it (auto: for every network) (train.py --microbatch)")
    parser.add_argument("--update", choices=["fused", "blocked", "auto"], default="fused",
                        help="the SGD update of every plan, or auto: the optimizer chooses fused or blocked per plan, "
                             "compared with fused's none (train.py --update)")
    args = parser.parse_args()
    fronts = {}
    for item in args.microbatch:
        if item == "auto":     # every network not named otherwise
            fronts.update((name, "auto") for name in args.models if name not in fronts)
            continue
        network, _, front = item.partition("=")
        blob, _, samples = front.rpartition(":")
        if front == "auto" and network:
            fronts[network] = "auto"
        elif not network or not blob or not samples.isdigit():
            parser.error(f"--microbatch: expected NETWORK=BLOB:SAMPLES, NETWORK=auto or auto, got {item!r}")
        else:
            fronts[network] = (blob, int(samples))
    cost = reference_model()
    if args.measure:
        with blas.threads(1):
            cost = FlopModel(*measure_rates(), source="measured")
    if args.gemm or args.bandwidth:
        cost = FlopModel(args.gemm or cost.gemm_flops, args.bandwidth or cost.bandwidth)
    print(f"cost model: {cost.describe()}\n")
    columns = args.columns
    print("| network (batch 64) | none MiB | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    ratios = {}
    for name in args.models:
        started = time.perf_counter()

        def progress(column, cell, name=name, started=started):
            shown = "-" if cell is None else f"{cell[0]:.2f}x" + ("" if cell[1] is None else f" ({100 * cell[1]:.0f}%)")
            print(f"{name} {column}: {shown} after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

        row, none = cells(name, cost, columns, fronts.get(name, ()), args.update, progress)
        shown = []
        for column in columns:
            if row.get(column) is None:
                shown.append("-")
                continue
            ratio, overhead, chosen = row[column]
            ratios.setdefault(column, {})[name] = ratio
            notes = ([] if overhead is None else [f"{100 * overhead:.0f}%"])
            if fronts.get(name) == "auto" and chosen is not None and chosen.microbatch:
                notes.append(f"front {chosen.microbatch[0]}:{chosen.microbatch[1]}"
                             + "".join(f", span to {through}:{samples}" for _, through, samples in chosen.spans))
            if args.update == "auto" and chosen is not None and chosen.update == "blocked":
                notes.append("blocked update")
            shown.append(f"{ratio:.2f}x" + (f" ({', '.join(notes)})" if notes else ""))
        front = fronts.get(name)
        front = ("" if front is None else " (front chosen: --microbatch auto)" if front == "auto"
                 else f" (front through {front[0]}, {front[1]} at a time)")
        print(f"| {name}{front} | {none / 2**20:,.0f} | " + " | ".join(shown) + " |", flush=True)
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print()
    for column in columns:
        paper = [ratios.get(column, {}).get(n) for n in PAPER]
        if all(v is not None for v in paper):
            print(f"{column}: paper's five networks average {sum(paper) / len(paper):.2f}x")


if __name__ == "__main__":
    main()
