"""CuPy's rules, checked on the CPU during real training steps (minigist/gpu/rules.py).

    python tools/cupy_rules.py --models vgg_small,resnet20,inception_small --gist none,lossless,all

One row per model and Gist mode: the rule violations seen (overlapping out=, matmul copies,
allocations outside the arena beyond the allowance, subnormal arithmetic, cupy API misuse),
the host syncs, array-module calls and kernel launches per step; then the first findings
(with --verbose, all of them), and a last line `violations: V, host syncs per step: S` (the
largest S over the rows). Exit status 1 when V > 0 or S > --max-syncs.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minigist.gpu.rules import check_training  # noqa: E402

MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg_small,resnet20,inception_small")
    parser.add_argument("--gist", default="none,lossless,all")
    parser.add_argument("--dpr", default="fp16")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="recorded steps per row (after one unrecorded)")
    parser.add_argument("--max-syncs", type=float, default=2)
    parser.add_argument("--verbose", action="store_true", help="every finding, not the first few")
    args = parser.parse_args(argv)
    total, worst = 0, 0.0
    print("| model | gist | violations | host syncs / step | calls / step | kernels / step | allowed bytes / step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    findings = []
    for model in args.models.split(","):
        path = model if model.endswith(".prototxt") else os.path.join(MODELS_DIR, model + ".prototxt")
        for gist in args.gist.split(","):
            report = check_training(path, gist, batch_size=args.batch_size, steps=args.steps, dpr=args.dpr)
            s = report.summary()
            total += s["violations"]
            worst = max(worst, s["host_syncs_per_step"])
            print(f"| {model} | {gist} | {s['violations']} | {s['host_syncs_per_step']:g} | {s['calls_per_step']:.0f} "
                  f"| {s['kernels_per_step']:.0f} | {s['allowed_bytes_per_step']:,.0f} |")
            lines = report.lines(limit=None if args.verbose else 8)
            if lines:
                findings.append(f"{model} {gist}:")
                findings.extend(lines)
    if findings:
        print("\n".join(findings))
    print(f"violations: {total}, host syncs per step: {worst:g}")
    return 1 if total or worst > args.max_syncs else 0


if __name__ == "__main__":
    sys.exit(main())
