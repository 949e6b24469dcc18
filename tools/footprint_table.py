"""The README's footprint table: every bundled model at batch 64 under the three allocation
modes, planned from shapes alone (exact byte counts, nothing allocated), with no Gist and the
SGD update fused into the backward pass (train.py's default), and the static plan with the
update after the whole backward pass (`--update separate`) for comparison.

    python tools/footprint_table.py            # prints the markdown table
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minigist.pipeline import plan_footprint  # noqa: E402

MODELS = ["alexnet", "nin", "overfeat", "vgg16", "googlenet", "inception_v3", "resnet50",
          "vgg_small", "resnet20", "inception_small"]


def mib(nbytes):
    return f"{nbytes / 2**20:,.1f}"


def main(batch_size=64):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")
    print(f"| model (batch {batch_size}, conv im2col) | none MiB | static MiB | dynamic MiB | lower bound MiB | "
          f"static / bound | dynamic fragmentation MiB | none / static | static, separate update MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    start = time.perf_counter()
    for name in MODELS:
        path = os.path.join(here, name + ".prototxt")
        reports = {mode: plan_footprint(path, batch_size=batch_size, alloc=mode, update="fused", conv="im2col")
                   for mode in ("none", "static", "dynamic")}
        separate = plan_footprint(path, batch_size=batch_size, alloc="static", update="separate", conv="im2col")
        static, dynamic = reports["static"], reports["dynamic"]
        bound = static["live_peak_bytes"]
        print(f"| {name} | {mib(reports['none']['footprint_bytes'])} | {mib(static['footprint_bytes'])} | "
              f"{mib(dynamic['footprint_bytes'])} | {mib(bound)} | {static['footprint_bytes'] / bound:.4f} | "
              f"{mib(dynamic['pool']['fragmentation_bytes'])} | "
              f"{reports['none']['footprint_bytes'] / static['footprint_bytes']:.2f}x | "
              f"{mib(separate['footprint_bytes'])} |")
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
