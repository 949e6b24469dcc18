"""Times a new user's first run, `python train.py` on the bundled defaults, as the README's
quick start makes it: numba's cache empty (a new NUMBA_CACHE_DIR, so that the run compiles
minigist's kernels), natively and as on a CPU with AVX2 and no AVX-512 (`--isa avx2`).

    python bench/first_run.py                          # native, then emulated AVX2
    python bench/first_run.py --isa avx2 --repeats 2
    python bench/first_run.py -- --model vgg_small     # flags after -- go to train.py

Each row: the wall time of the whole process (from its start to its exit), the seconds until
training starts (its `data` line: start-up, numba's compiles, the data, the plan, SSDC's
density calibration; kernels first needed by a training step compile in it), the training
seconds train.py reports, its held-out accuracy and images/s, and `others`: the share of the
machine's CPU time that other processes (and the hypervisor's steal) took meanwhile. The
target the first run is held to: under 90 s wall on a 2-core AVX2 machine, held-out accuracy
at least 97%. Exit status 1 when a run fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import load
from suite_time import ISAS, isa_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_SECONDS, TARGET_ACCURACY = 90.0, 0.97


def first_run(isa, extra, cache_dir):
    """One `python train.py` with an empty numba cache: a dict of what the row shows."""
    env = dict(os.environ, **isa_environment(isa), NUMBA_CACHE_DIR=cache_dir)
    before = load.sample(children=True)
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *extra], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    to_training, lines = None, []
    for line in process.stdout:
        if to_training is None and line.startswith("data "):
            to_training = time.monotonic() - start
        lines.append(line)
    status = process.wait()
    wall = time.monotonic() - start
    after = load.sample(children=True)
    text = "".join(lines)
    done = re.search(r"^done: .* in ([0-9.]+) s this run, ([0-9.]+) training images/s", text, re.M)
    accuracy = re.search(r"^held-out accuracy ([0-9.]+) \((\d+/\d+)\)", text, re.M)
    return {"status": status, "wall": wall, "to_training": to_training, "others": load.others_share(before, after),
            "train": float(done.group(1)) if done else None, "rate": float(done.group(2)) if done else None,
            "accuracy": float(accuracy.group(1)) if accuracy else None,
            "correct": accuracy.group(2) if accuracy else "", "last": lines[-1].strip() if lines else ""}


def cell(value, form):
    return "-" if value is None else format(value, form)


def main(argv):
    extra = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", default="native,avx2", help="comma list of native, avx2 (default both)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per instruction set (default 1)")
    args = parser.parse_args(argv)
    isas = [i for i in args.isa.split(",") if i]
    unknown = set(isas) - set(ISAS)
    if unknown or args.repeats < 1:
        parser.error(f"--isa: unknown {', '.join(sorted(unknown))}" if unknown else "--repeats: at least 1")
    print(f"{os.cpu_count()} CPUs; 1-minute load average before: {os.getloadavg()[0]:.2f}; "
          f"python train.py {' '.join(extra)}".rstrip(), flush=True)
    rows, failed = [], False
    scratch = tempfile.mkdtemp(prefix="first_run-")
    try:
        for repeat in range(args.repeats):
            for isa in isas:
                cache_dir = os.path.join(scratch, f"{isa}-{repeat}")      # a new, empty numba cache
                os.makedirs(cache_dir)
                row = first_run(isa, extra, cache_dir)
                failed = failed or row["status"] != 0
                rows.append((isa, row))
                print(f"{isa}: {row['wall']:.1f} s wall, status {row['status']}: {row['last']}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n| isa | wall s | to training s | training s | images/s | held-out accuracy | others | "
          f"under {TARGET_SECONDS:.0f} s and >= {TARGET_ACCURACY:.0%} |\n|---|---:|---:|---:|---:|---:|---:|---|")
    for isa, row in rows:
        met = (row["status"] == 0 and row["accuracy"] is not None and row["wall"] < TARGET_SECONDS
               and row["accuracy"] >= TARGET_ACCURACY)
        accuracy = f"{row['accuracy']:.3f} ({row['correct']})" if row["accuracy"] is not None else "-"
        print(f"| {isa} | {row['wall']:.1f} | {cell(row['to_training'], '.1f')} | {cell(row['train'], '.1f')} | "
              f"{cell(row['rate'], '.1f')} | {accuracy} | {row['others']} | {'yes' if met else 'no'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
