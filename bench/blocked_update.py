"""--update blocked against --update fused on VGG-16's classifier: footprint and step time.

    python bench/blocked_update.py                       # batch 64, 15 pairs
    python bench/blocked_update.py --batch-size 32 --repeats 31

The net is VGG-16's fc6 (25088 -> 4096, a 411 MB weight gradient), ReLU and a 1000-way
fc8 with its loss, on random inputs, one BLAS thread. Both nets train side by side, one step
each in turn, and the ratio is the median of the pairs' ratios (a machine's drift hits both
alike). The footprints are the static plans' exact bytes.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import minigist  # noqa: E402
from minigist import blas  # noqa: E402

CLASSIFIER = """
name: "vgg16_classifier"
layer {{ name: "data" type: "Input" top: "data" top: "label"
  input_param {{ shape {{ dim: {batch} dim: 25088 }} shape {{ dim: {batch} }} }} }}
layer {{ name: "fc6" type: "InnerProduct" bottom: "data" top: "fc6"
  inner_product_param {{ num_output: 4096 weight_filler {{ type: "gaussian" std: 0.005 }} }} }}
layer {{ name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }}
layer {{ name: "fc8" type: "InnerProduct" bottom: "fc6" top: "fc8"
  inner_product_param {{ num_output: 1000 weight_filler {{ type: "gaussian" std: 0.01 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 25088)).astype(np.float32)
    labels = rng.integers(0, 1000, args.batch_size)
    with tempfile.TemporaryDirectory() as folder, blas.threads(1):
        path = os.path.join(folder, "classifier.prototxt")
        with open(path, "w") as handle:
            handle.write(CLASSIFIER.format(batch=args.batch_size))
        nets = [minigist.Net(path, update=update, threads=1) for update in ("fused", "blocked")]
        for net in nets:        # a warm-up step each
            net.train_step(x, labels)
        ratios, seconds = [], []
        for _ in range(args.repeats):
            times = []
            for net in nets:
                tick = time.perf_counter()
                net.train_step(x, labels)
                times.append(time.perf_counter() - tick)
            ratios.append(times[1] / times[0])
            seconds.append(times[0])
        same = all(np.array_equal(a, b) for a, b in zip(nets[0].params().values(), nets[1].params().values()))
    fused, blocked = (net.report()["footprint_bytes"] for net in nets)
    print(f"footprint: fused {fused:,} bytes, blocked {blocked:,} bytes ({fused / blocked:.2f}x less)")
    print(f"step time: blocked / fused {np.median(ratios):.3f} (median of {args.repeats} pairs; "
          f"fused {1e3 * np.median(seconds):.0f} ms a step)")
    print(f"weights after {args.repeats + 1} steps: {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
