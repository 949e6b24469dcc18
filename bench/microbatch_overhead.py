"""The micro-batched front's step time against its prediction, on vgg_small.

    python bench/microbatch_overhead.py                       # fronts pool1:1, pool2:1, pool2:4, pool3:1
    python bench/microbatch_overhead.py --fronts pool2:4 --repeats 41

At batch 32 (static allocation, fused update, --gist none, the im2col engine, one BLAS
thread, one-sample batch chunks: at vgg_small's own chunks conv1_1 takes the whole batch in
one, and no micro-batch holds it), each front (train.py --microbatch) trains side by side with
the whole front: the two alternate, one step each, and the measured overhead is the median of
the pairs' ratios. The prediction beside it: the FLOP model at this machine's measured rates
(what --plan-only --measure-rates uses; a training run's measured cost model profiles the
net at its own chunks, and predicts a front's steps from the same FLOPs and bytes, scaled).
The weights after the run are compared bit for bit with the whole front's.
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import minigist  # noqa: E402
from minigist import blas  # noqa: E402
from minigist.costmodel import flop_model  # noqa: E402
from minigist.optimize import Settings  # noqa: E402
from minigist.pipeline import Options  # noqa: E402
from optimize_overhead import batches, side_by_side  # noqa: E402

MODEL = os.path.join(ROOT, "models", "vgg_small.prototxt")
FRONTS = ["pool1:1", "pool2:1", "pool2:4", "pool3:1"]


def front_spec(text):
    blob, _, samples = text.rpartition(":")
    if not blob or not samples.isdigit():
        raise argparse.ArgumentTypeError(f"expected BLOB:SAMPLES, got {text!r}")
    return blob, int(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", nargs="*", type=front_spec, default=[front_spec(f) for f in FRONTS])
    parser.add_argument("--repeats", type=int, default=31, help="timed pairs of steps per front")
    args = parser.parse_args()
    base = Options(batch_size=32, update="fused", conv="im2col", gist="none", chunk_bytes=1)
    data = batches(4)
    with blas.threads(1):
        rates = flop_model()
        print(f"vgg_small, batch 32, one-sample chunks; {rates.describe()}\n")
        print("| front | footprint (x less than whole) | predicted | measured | weights |")
        print("|---|---:|---:|---:|---|")
        for front in args.fronts:
            nets = [minigist.Net(MODEL, seed=1, threads=1, plan=Settings(base.replace(microbatch=m)))
                    for m in ((), front)]
            programs = [net.compiled["train"].program for net in nets]
            predicted = rates.program_seconds(programs[1]) / rates.program_seconds(programs[0]) - 1
            overhead, _ = side_by_side(nets, data, args.repeats)
            same = all(np.array_equal(value, nets[1].params()[key]) for key, value in nets[0].params().items())
            ratio = nets[0].report()["footprint_bytes"] / nets[1].report()["footprint_bytes"]
            print(f"| {front[0]}:{front[1]} | {ratio:.2f}x | {100 * predicted:+.1f}% | {100 * overhead:+.1f}% "
                  f"| {'identical' if same else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    main()
