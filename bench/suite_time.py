"""Times the README's test command (`python -m pytest -q`, the full suite) and its quick subset
(`-m "not slow"`) on this machine: with numba's cache cold (an empty NUMBA_CACHE_DIR, so that
the run compiles minigist's kernels, as a machine's first run does) and warm (the same folder
again), on this CPU or as on one with AVX2 and no AVX-512 (`--isa avx2`), for one checkout or
several side by side (each condition runs on every checkout in turn, so that what else the
machine does hits them alike).

    python bench/suite_time.py                                   # this checkout: full and quick, cold and warm
    git worktree add ../main-copy main
    python bench/suite_time.py --checkouts ../main-copy . --isa native,avx2 --per-file

Each row: the wall time of the pytest run, its last line (passed, skipped), the CPU seconds it
and the processes it started used, and `others`: the share of the machine's CPU time that
other processes (and the hypervisor's steal) took meanwhile. Each checkout runs its own code:
its folder leads PYTHONPATH, which the train.py processes of the tests inherit. Exit status 1
when a run fails.
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

import load

SUBSETS = {"full": [], "quick": ["-m", "not slow"]}
CACHES = ("cold", "warm")
ISAS = ("native", "avx2")


def isa_environment(isa):
    if isa == "native":
        return {}
    from minigist import jit
    return jit.avx2_environment()


def run_suite(checkout, subset, isa, cache_dir, junit):
    """One pytest run of `subset` in `checkout`; a dict of what the row shows."""
    path = os.pathsep.join([checkout] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = dict(os.environ, **isa_environment(isa), NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=path)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *SUBSETS[subset]]
    before = load.sample(children=True)
    result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    after = load.sample(children=True)
    lines = result.stdout.strip().splitlines()
    return {"wall": after[0] - before[0] if before and after else float("nan"),
            "cpu": after[3] - before[3] if before and after else float("nan"),
            "others": load.others_share(before, after), "last": lines[-1] if lines else "", "status": result.returncode,
            "files": seconds_by_file(junit)}


def seconds_by_file(junit):
    """Test file -> (seconds, tests) from a junit XML report (setup, call and teardown)."""
    totals = collections.defaultdict(lambda: [0.0, 0])
    try:
        cases = ElementTree.parse(junit).getroot().iter("testcase")
    except (OSError, ElementTree.ParseError):
        return {}
    for case in cases:
        name = case.get("classname", "").split(".")[-1] + ".py"
        totals[name][0] += float(case.get("time", 0))
        totals[name][1] += 1
    return dict(totals)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkouts", nargs="+", default=[os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
                        help="folders of minigist checkouts (default: this one)")
    parser.add_argument("--subsets", default="full,quick", help="comma list of full, quick (default both)")
    parser.add_argument("--isa", default="native", help="comma list of native, avx2 (default native)")
    parser.add_argument("--cache", default="cold,warm",
                        help="comma list of cold, warm (default both; warm alone warms the cache first, untimed)")
    parser.add_argument("--per-file", action="store_true", help="also the seconds of each test file, per run")
    args = parser.parse_args()
    subsets, isas, caches = (args.subsets.split(","), args.isa.split(","), args.cache.split(","))
    for given, allowed in ((subsets, SUBSETS), (isas, ISAS), (caches, CACHES)):
        unknown = set(given) - set(allowed)
        if unknown:
            parser.error(f"unknown {', '.join(sorted(unknown))} (choose from {', '.join(allowed)})")
    checkouts = [os.path.abspath(c) for c in args.checkouts]
    print(f"{os.cpu_count()} CPUs; 1-minute load average before: {os.getloadavg()[0]:.2f}; "
          f"{sys.executable}, pytest in each checkout")
    rows, failed = [], False
    scratch = tempfile.mkdtemp(prefix="suite_time-")
    try:
        for isa in isas:
            for subset in subsets:
                # one numba cache folder per checkout: empty for the cold run, kept for the warm one
                folders = {c: os.path.join(scratch, f"{isa}-{subset}-{i}") for i, c in enumerate(checkouts)}
                for cache in CACHES:
                    if cache not in caches and not (cache == "cold" and "warm" in caches):
                        continue
                    for index, checkout in enumerate(checkouts):
                        os.makedirs(folders[checkout], exist_ok=True)
                        junit = os.path.join(scratch, f"{isa}-{subset}-{cache}-{index}.xml")
                        row = run_suite(checkout, subset, isa, folders[checkout], junit)
                        failed = failed or row["status"] != 0
                        if cache in caches:
                            rows.append((subset, isa, cache, checkout, row))
                            print(f"{subset} {isa} {cache} {checkout}: {row['wall']:.1f} s, {row['last']}",
                                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("\n| subset | isa | numba cache | checkout | wall | pytest | CPU s | others |\n|---|---|---|---|---|---|---|---|")
    for subset, isa, cache, checkout, row in rows:
        print(f"| {subset} | {isa} | {cache} | {checkout} | {row['wall']:.1f} s | {row['last']} | "
              f"{row['cpu']:.0f} | {row['others']} |")
    if args.per_file:
        for subset, isa, cache in dict.fromkeys((r[0], r[1], r[2]) for r in rows):
            runs = [r for r in rows if r[:3] == (subset, isa, cache)]
            files = sorted({f for r in runs for f in r[4]["files"]}, key=lambda f: -runs[-1][4]["files"].get(f, (0,))[0])
            print(f"\n{subset}, {isa}, {cache} cache: seconds per test file (tests)\n")
            print("| file | " + " | ".join(r[3] for r in runs) + " |\n|---|" + "---|" * len(runs))
            for name in files:
                cells = [r[4]["files"].get(name) for r in runs]
                print(f"| {name} | " + " | ".join(f"{c[0]:.1f} ({c[1]})" if c else "-" for c in cells) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
