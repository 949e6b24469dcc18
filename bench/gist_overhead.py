"""Time a training step with and without Gist on the CPU-size models, side by side in one run.

    python bench/gist_overhead.py [--batch-size 32] [--repeats 7] [--models vgg_small,resnet20]
                                  [--conv im2col|onednn]

For each model the nets (gist none, lossless, lossy fp16, all fp16) are built once, warmed up,
then timed in alternation (none, lossless, ..., none, lossless, ...) so that machine noise hits
every mode alike; the reported figures are the median step time and, in brackets, the median
over the rounds of the step's time over `none`'s in the same round. A last
line gives the machine's memory copy rate before and after the run (the codecs are passes over
memory, so their share of a step grows when memory is slow). With numba installed the codecs
run their compiled kernels, and one more column times `all fp16` with the codecs on their
ufunc path (minigist.codecs.kernels.use_codec_kernels(False); MAX pooling's
kernels stay on, as in the other columns) in the same run. `--conv` picks the convolution
engine of every net (im2col, the default, or onednn).
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import isa  # noqa: E402
import minigist  # noqa: E402
from minigist.codecs import kernels  # noqa: E402
from minigist import blas, onednn  # noqa: E402

CONFIGS = [("none", "none", "fp16"), ("lossless", "lossless", "fp16"), ("lossy fp16", "lossy", "fp16"),
           ("all fp16", "all", "fp16")]
if kernels.available():       # the same mode on the ufunc path, for comparison
    CONFIGS.append(("all fp16, ufunc codecs", "all", "fp16"))


def copy_rate():
    """GB/s of one 64 MiB copy (median of 5): Gist's codecs are passes over memory, and this
    machine has states where memory is much slower than usual (its ratios then rise)."""
    src = np.ones(16 << 20, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default="vgg_small,resnet20,inception_small")
    parser.add_argument("--conv", default="im2col", choices=list(minigist.CONV_ENGINES),
                        help="the convolution engine of every net (default im2col)")
    isa.add_argument(parser)
    args = parser.parse_args()
    isa.rerun_if_emulating(args.isa)
    rng = np.random.default_rng(0)
    print(f"codecs: {kernels.describe()}; convolutions: {args.conv}; instruction set: {isa.describe()}")
    rate_before = copy_rate()
    print(f"| model (batch {args.batch_size}) | " + " | ".join(f"{label} s/step (ratio)" for label, _, _ in CONFIGS) + " |")
    print("|---|" + "---:|" * len(CONFIGS))
    for name in args.models.split(","):
        path = os.path.join(ROOT, "models", name + ".prototxt")
        batches = [(rng.standard_normal((args.batch_size, 3, 32, 32)).astype(np.float32),
                    rng.integers(0, 10, args.batch_size)) for _ in range(2)]
        nets = {}
        for label, gist, dpr in CONFIGS:
            # the process's thread counts, as this bench ran before Net applied its default policy
            threads = blas.get_threads() if args.conv == "im2col" else onednn.max_threads()
            net = minigist.Net(path, batch_size=args.batch_size, seed=0, gist=gist, dpr=dpr, conv=args.conv,
                               threads=threads)
            net.calibrate(batches)
            net.train_step(*batches[0])   # warm-up: first touch of the arena
            nets[label] = net
        times = {label: [] for label in nets}
        for repeat in range(args.repeats):
            for label, net in nets.items():
                with kernels.use_codec_kernels("ufunc" not in label):
                    start = time.perf_counter()
                    net.train_step(*batches[repeat % 2])
                    times[label].append(time.perf_counter() - start)
        # a round's ratio cancels the machine's drift between rounds, which a ratio of the
        # two medians keeps
        cells = [f"{statistics.median(t):.3f} ({statistics.median(a / b for a, b in zip(t, times['none'])):.3f})"
                 for t in times.values()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"memory copy rate before / after: {rate_before:.1f} / {copy_rate():.1f} GB/s (read + write)")


if __name__ == "__main__":
    main()
