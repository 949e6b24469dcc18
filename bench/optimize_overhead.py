"""The optimizer's predicted step-time overhead against the measured one, on the CPU models.

    python bench/optimize_overhead.py                 # vgg_small, resnet20, inception_small
    python bench/optimize_overhead.py --repeats 15 --models resnet20

For each model at batch 32 (static allocation, fused update, the im2col engine, one BLAS
thread): the footprint of `--gist none`, then budgets 1.25x, 1.5x, 2x, 3x and 4x smaller. For each budget
the optimizer chooses with the measured cost model (a profiling run of this machine's steps,
minigist/costmodel.py), the chosen plan trains, and its median step time is measured side by
side with the `none` plan's (the two alternate, one step each, so that a machine's drift hits
both alike). Printed: the footprint reached, the predicted overhead and the measured one. A
budget nothing fits prints the smallest footprint reachable instead. SSDC's densities are
calibrated on the same random batches the steps run on (ReLU maps about half zeros).
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import minigist  # noqa: E402
from minigist import blas  # noqa: E402
from minigist.costmodel import MeasuredModel, flop_model, profile  # noqa: E402
from minigist.errors import MinigistError  # noqa: E402
from minigist.optimize import Optimizer  # noqa: E402

MODELS = ["vgg_small", "resnet20", "inception_small"]
# the 2x, 3x and 4x, and two budgets the small models reach at batch 32 (their smallest
# plans are 1.2x-1.8x below none: im2col workspace and the gradients fill their peaks)
FACTORS = (1.25, 1.5, 2, 3, 4)
BATCH = 32


def batches(count, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, BATCH))
            for _ in range(count)]


def side_by_side(nets, data, repeats):
    """Median seconds of one training step of each net, the nets alternating step by step."""
    times = [[] for _ in nets]
    for net in nets:       # a warm-up step each
        net.train_step(*data[0])
    for index in range(repeats):
        batch = data[index % len(data)]
        for k, net in enumerate(nets):
            tick = time.perf_counter()
            net.train_step(*batch)
            times[k].append(time.perf_counter() - tick)
    return [float(np.median(t)) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    data = batches(3)
    print("| model | budget | footprint MiB (x less) | predicted overhead | measured overhead | difference |")
    print("|---|---|---:|---:|---:|---:|")
    with blas.threads(1):
        fallback = flop_model()
        for name in args.models:
            path = os.path.join(ROOT, "models", name + ".prototxt")
            lossless = minigist.Net(path, batch_size=BATCH, gist="lossless", update="fused", threads=1)
            lossless.calibrate(data[:2])
            none = minigist.Net(path, batch_size=BATCH, update="fused", threads=1)
            cost = MeasuredModel(profile([none, lossless], data[0]), fallback, 2)
            cost.calibrate([n.compiled["train"].program for n in (none, lossless)])
            optimizer = Optimizer(path, lossless.options.replace(gist="lossless"), cost)
            base = optimizer.baseline_footprint
            for factor in FACTORS:
                budget = int(base / factor)
                try:
                    plan = optimizer.fit(budget)
                except MinigistError as exc:
                    print(f"| {name} | {factor}x ({budget / 2**20:.1f} MiB) | unreachable: "
                          f"{str(exc).split(': ', 2)[-1][:120]} | | | |", flush=True)
                    continue
                net = minigist.Net(path, plan=plan, threads=1)
                plain, chosen = side_by_side([none, net], data, args.repeats)
                measured = chosen / plain - 1
                print(f"| {name} | {factor}x ({budget / 2**20:.1f} MiB) | {plan.footprint_bytes / 2**20:.1f} "
                      f"({plan.ratio:.2f}x) | {100 * plan.predicted_overhead:+.1f}% | {100 * measured:+.1f}% | "
                      f"{100 * (measured - plan.predicted_overhead):+.1f} pp |", flush=True)


if __name__ == "__main__":
    main()
