"""Time each codec's encode and decode on the ufunc path and on the compiled kernels, side by side.

    python bench/codec_kernels.py [--elements 524288] [--density 0.5] [--repeats 21]

The tensor is a ReLU-like float32 map (standard normal, then `density` of it kept non-zero);
the codecs are DPR (each format), SSDC with float32 and with fp16 values (the format SSDC picks
for that density), all on planned buffers. Each row alternates the two paths, `repeats` times,
and reports the median milliseconds and the speed-up. Needs numba (pip install minigist[fast]).
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minigist.codecs import kernels  # noqa: E402
from minigist.codecs.dpr import DPR, FORMATS  # noqa: E402
from minigist.codecs.ssdc import SSDC  # noqa: E402


def buffers(decls):
    return {name: np.empty(decl.shape, decl.dtype) for name, decl in decls.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 19)
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if not kernels.available():
        sys.exit("bench/codec_kernels.py needs numba: pip install minigist[fast]")
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal(args.elements)).astype(np.float32)
    x[rng.random(args.elements) >= args.density] = 0
    codecs = [DPR(fmt) for fmt in FORMATS]
    nnz = int(np.count_nonzero(x))
    codecs += [SSDC(nnz, "fp32"), SSDC(nnz, "fp16")]
    print(f"{args.elements} elements, {nnz / args.elements:.0%} non-zero; median ms over {args.repeats} "
          f"alternated runs")
    print("| codec | encode ufunc | encode kernel | speed-up | decode ufunc | decode kernel | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for codec in codecs:
        shape = x.shape
        enc = buffers(codec.encoded(shape))
        ws_encode, ws_decode = buffers(codec.workspace(shape, "encode")), buffers(codec.workspace(shape, "decode"))
        out = np.empty(shape, np.float32)
        steps = {"encode": lambda: codec.encode(np, x, enc, ws_encode),
                 "decode": lambda: codec.decode(np, enc, out, ws_decode)}
        cells = []
        for phase, run in steps.items():
            times = {False: [], True: []}
            for flag in (False, True):          # warm-up (and the first compile)
                with kernels.use_kernels(flag):
                    steps["encode"]()
                    run()
            for _ in range(args.repeats):
                for flag in (False, True):
                    with kernels.use_kernels(flag):
                        start = time.perf_counter()
                        run()
                        times[flag].append(time.perf_counter() - start)
            ufunc, kernel = (statistics.median(times[flag]) * 1e3 for flag in (False, True))
            cells += [f"{ufunc:.3f}", f"{kernel:.3f}", f"{ufunc / kernel:.1f}x"]
        label = codec.name if not isinstance(codec, SSDC) else f"{codec.name} ({SSDC.header(enc)[0]})"
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
