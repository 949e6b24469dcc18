"""The README's accuracy table: the default training run (`python train.py`: ResNet-20 on the
bundled MNIST-5k digits, 5 epochs, fixed 4,000 / 1,000 stratified split) under each Gist mode.

    python tools/accuracy_table.py [extra train.py flags]

Each mode is one full run of train.py (about 2 minutes each on 2 cores).
"""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODES = [("none", ["--gist", "none"]), ("lossless", ["--gist", "lossless"]),
         ("lossy fp16", ["--gist", "lossy", "--dpr", "fp16"]), ("lossy fp10", ["--gist", "lossy", "--dpr", "fp10"]),
         ("lossy fp8-e4m3", ["--gist", "lossy", "--dpr", "fp8-e4m3"]),
         ("lossy fp8-e5m2", ["--gist", "lossy", "--dpr", "fp8-e5m2"]), ("all fp16", ["--gist", "all", "--dpr", "fp16"])]


def main(extra):
    print("| gist | held-out accuracy | held-out loss | footprint MiB | run time s |")
    print("|---|---:|---:|---:|---:|")
    for label, flags in MODES:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--conv", "im2col"] + flags + extra,
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            print(f"| {label} | failed: {run.stderr.strip().splitlines()[-1]} | | | |")
            continue
        accuracy = re.search(r"held-out accuracy ([0-9.]+) \((\d+)/(\d+)\), loss ([0-9.]+)", run.stdout)
        footprint = re.search(r"^footprint: ([\d,]+) B", run.stdout, re.M)
        mib = int(footprint.group(1).replace(",", "")) / 2**20
        print(f"| {label} | {float(accuracy.group(1)):.3f} ({accuracy.group(2)}/{accuracy.group(3)}) | "
              f"{float(accuracy.group(4)):.4f} | {mib:.1f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
