"""The README's per-rank table: the paper's five networks trained data-parallel on 8 ranks at
a global batch of 512 (64 images per rank), one rank's footprint under each --shard mode,
planned from shapes alone (exact byte counts, nothing allocated, no MPI), next to one process
at batch 64. No Gist, static allocation, the SGD update fused into the backward pass (train.py's
default), 25 MiB buckets.

    python tools/distributed_table.py [RANKS] [GLOBAL_BATCH]      # prints the markdown tables

Each figure is what `python train.py --model NAME --plan-only --gist none --ranks 8
--batch-size 512 --shard MODE` prints as its footprint.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minigist.passes.reduce import SHARDS  # noqa: E402
from minigist.pipeline import plan_footprint  # noqa: E402

MODELS = ["alexnet", "nin", "overfeat", "vgg16", "googlenet"]
KEPT = ("weights", "weight_grads", "optimizer_state")


def mib(nbytes):
    return f"{nbytes / 2**20:,.1f}"


def main(ranks=8, global_batch=512):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")
    local = global_batch // ranks
    start = time.perf_counter()
    print(f"| network | one process, batch {local} MiB | " + " | ".join(f"`{shard}` MiB" for shard in SHARDS)
          + " | `gradients` / `none` | `weights` / `none` |")
    print("|---|" + "---:|" * (len(SHARDS) + 3))
    kept_rows = []
    for name in MODELS:
        path = os.path.join(here, name + ".prototxt")
        single = plan_footprint(path, batch_size=local, gist="none", update="fused")
        reports = {shard: plan_footprint(path, batch_size=global_batch, gist="none", update="fused", ranks=ranks,
                                         shard=shard) for shard in SHARDS}
        sizes = {shard: report["footprint_bytes"] for shard, report in reports.items()}
        print(f"| {name} | {mib(single['footprint_bytes'])} | " + " | ".join(mib(sizes[s]) for s in SHARDS)
              + f" | {sizes['gradients'] / sizes['none']:.3f} | {sizes['weights'] / sizes['none']:.3f} |")
        kept_rows.append((name, reports))
    print("\nWhat a rank keeps between steps, `none` -> `weights` (MiB), and the largest bucket:\n")
    print("| network | weights | momentum | largest bucket MiB |")
    print("|---|---:|---:|---:|")
    for name, reports in kept_rows:
        none, sharded = (reports[s]["distributed"]["persistent_by_category"] for s in ("none", "weights"))
        largest = max(b["bytes"] for b in reports["none"]["distributed"]["buckets"])
        print(f"| {name} | {mib(none['weights'])} -> {mib(sharded['weights'])} | "
              f"{mib(none['optimizer_state'])} -> {mib(sharded['optimizer_state'])} | {mib(largest)} |")
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
