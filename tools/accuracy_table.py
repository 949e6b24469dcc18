"""The README's accuracy tables: the default training run (`python train.py`: ResNet-20 on the
bundled MNIST-5k digits, 5 epochs, fixed 4,000 / 1,000 stratified split) under each Gist mode,
and each bundled small model's own default run.

    python tools/accuracy_table.py                                  # resnet20 under every Gist mode, im2col
    python tools/accuracy_table.py --models vgg_small,resnet20,inception_small --modes default --conv auto
    python tools/accuracy_table.py --modes none,lossless -- --epochs 2   # flags after -- go to train.py

Each row is one full run of train.py (1-2 minutes on 2 cores); `--conv` is passed to every
run (im2col by default, so that the Gist table does not depend on whether oneDNN is installed;
`auto` is train.py's own default). `default` names no Gist flag: the run `python train.py
--model M` makes (`--gist lossless`). Exit status 1 when a run fails.
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODES = {"default": [], "none": ["--gist", "none"], "lossless": ["--gist", "lossless"],
         "lossy fp16": ["--gist", "lossy", "--dpr", "fp16"], "lossy fp10": ["--gist", "lossy", "--dpr", "fp10"],
         "lossy fp8-e4m3": ["--gist", "lossy", "--dpr", "fp8-e4m3"],
         "lossy fp8-e5m2": ["--gist", "lossy", "--dpr", "fp8-e5m2"], "all fp16": ["--gist", "all", "--dpr", "fp16"]}
GIST_MODES = [name for name in MODES if name != "default"]


def parse(argv):
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet20", help="comma list of bundled models (default resnet20)")
    parser.add_argument("--modes", default=",".join(GIST_MODES),
                        help=f"comma list of {', '.join(MODES)} (default: every Gist mode)")
    parser.add_argument("--conv", default="im2col", choices=("im2col", "onednn", "auto"),
                        help="the convolution engine of every run (default im2col)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    args.extra = extra
    return args


def run_row(model, flags, conv, extra):
    """One train.py run: the row's cells, or None and the reason it failed."""
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model, "--conv", conv] + flags + extra
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = (run.stderr.strip() or run.stdout.strip() or "no output").splitlines()
    if run.returncode != 0:
        return None, lines[-1]
    accuracy = re.search(r"held-out accuracy ([0-9.]+) \((\d+)/(\d+)\), loss ([0-9.]+)", run.stdout)
    footprint = re.search(r"^footprint: ([\d,]+) B", run.stdout, re.M)
    if not (accuracy and footprint):
        return None, "no held-out accuracy or footprint line in train.py's output"
    mib = int(footprint.group(1).replace(",", "")) / 2**20
    return (f"{float(accuracy.group(1)):.3f} ({accuracy.group(2)}/{accuracy.group(3)})",
            f"{float(accuracy.group(4)):.4f}", f"{mib:.1f}", f"{seconds:.0f}"), None


def main(argv):
    args = parse(argv)
    print("| model | gist | held-out accuracy | held-out loss | footprint MiB | run time s |")
    print("|---|---|---:|---:|---:|---:|")
    failed = False
    for model in args.models:
        for mode in args.modes:
            cells, why = run_row(model, MODES[mode], args.conv, args.extra)
            if cells is None:
                failed = True
                cells = (f"failed: {why}", "", "", "")
            print(f"| {model} | {mode} | " + " | ".join(cells) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
