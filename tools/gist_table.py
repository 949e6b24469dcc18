"""The README's Gist table: the paper's experiment, reproduced and extended, from plans alone
(exact byte counts, nothing allocated or run).

    python tools/gist_table.py            # prints the markdown tables

Networks at batch 64 and their ImageNet input sizes; the SGD update fused into the backward pass
(train.py's default: each weight gradient freed once applied; the separate update's ratios are
summarised after the tables); allocation static and dynamic; for each,
the footprint under Gist none, lossless, lossy (FP16), all (FP16) and all (FP8-E4M3), the
ratio to none under the same allocation, and the stash bytes by encoding. SSDC is planned from
the densities that tools/measure_densities.py measured (models/densities/NAME.json), 5% above
the densest batch seen, as Net.calibrate does. Planned for the im2col engine, so that the
tables do not depend on whether oneDNN is installed.
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from minigist.densities import planned, read_densities  # noqa: E402
from minigist.graph import build_graph  # noqa: E402
from minigist.pipeline import plan_footprint  # noqa: E402

PAPER = ["alexnet", "nin", "overfeat", "vgg16", "googlenet"]
EXTRA = ["resnet50", "inception_v3"]
CONFIGS = [("none", "none", "fp16"), ("lossless", "lossless", "fp16"), ("lossy fp16", "lossy", "fp16"),
           ("all fp16", "all", "fp16"), ("all fp8", "all", "fp8-e4m3")]


def densities(name):
    """The planned densities of models/densities/NAME.json, checked as train.py checks them."""
    path = os.path.join(ROOT, "models", "densities", name + ".json")
    graph = build_graph(os.path.join(ROOT, "models", name + ".prototxt"), "TRAIN", 1)
    return planned(read_densities(path, graph))


def gib(nbytes):
    return f"{nbytes / 2**30:.2f}"


def table(alloc, batch_size=64, update="fused"):
    rows, ratios = [], {}
    for name in PAPER + EXTRA:
        path = os.path.join(ROOT, "models", name + ".prototxt")
        density = densities(name)
        reports = {label: plan_footprint(path, batch_size=batch_size, alloc=alloc, gist=gist, dpr=dpr,
                                         ssdc_density=density, update=update, conv="im2col")
                   for label, gist, dpr in CONFIGS}
        base = reports["none"]["footprint_bytes"]
        cells = []
        for label, _, _ in CONFIGS:
            size = reports[label]["footprint_bytes"]
            ratios.setdefault(label, {})[name] = base / size
            cells.append(f"{gib(size)} ({base / size:.2f}x)")
        rows.append((name, cells, reports))
    return rows, ratios


def main():
    stash_rows = []
    for alloc in ("static", "dynamic"):
        rows, ratios = table(alloc)
        print(f"\n**{alloc} allocation**, batch 64, conv im2col: footprint GiB (ratio to none)\n")
        print("| network | " + " | ".join(label for label, _, _ in CONFIGS) + " |")
        print("|---|" + "---:|" * len(CONFIGS))
        for name, cells, reports in rows:
            print(f"| {name} | " + " | ".join(cells) + " |")
            if alloc == "static":
                stash_rows.append((name, reports))
        for label, _, _ in CONFIGS[1:]:
            paper = [ratios[label][n] for n in PAPER]
            print(f"\n{alloc}, {label}: paper's five networks average {sum(paper) / len(paper):.2f}x, "
                  f"max {max(paper):.2f}x; all seven max {max(ratios[label].values()):.2f}x", end="")
        print()
    print("\n**With the SGD update after the whole backward pass** (`--update separate`, as Caffe; every "
          "weight gradient live at once), static, batch 64\n")
    rows, ratios = table("static", update="separate")
    for label, _, _ in CONFIGS[1:]:
        paper = [ratios[label][n] for n in PAPER]
        print(f"- {label}: " + ", ".join(f"{n} {ratios[label][n]:.2f}x" for n in PAPER + EXTRA) +
              f"; paper's five average {sum(paper) / len(paper):.2f}x, max {max(paper):.2f}x")
    print("\n**Stash bytes by encoding** (static, batch 64, MiB)\n")
    encodings = ["fp32", "relu-pool-4bit", "mask-1bit", "index-4bit", "ssdc", "ssdc-fp16", "fp16", "ssdc-fp8-e4m3",
                 "fp8-e4m3", "uint8", "bool", "dropped"]
    print("| network | config | " + " | ".join(encodings) + " |")
    print("|---|---|" + "---:|" * len(encodings))
    for name, reports in stash_rows:
        for label in ("none", "lossless", "all fp16", "all fp8"):
            by = reports[label]["stash_by_encoding"]
            counts = {}
            for row in reports[label]["stash"]:
                counts[row["encoding"]] = counts.get(row["encoding"], 0) + 1
            cells = [f"{by[e] / 2**20:,.1f} ({counts[e]})" if e in by else "" for e in encodings]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
