"""The README's table of ONNX models: parameters and the training footprint under each Gist
mode, exact plans from shapes alone, for the small real CNN graphs the onnx wheel ships
(onnx/backend/test/data/light/) and the files tools/export_torchvision.py writes:

    python tools/export_torchvision.py runs/onnx     # in an environment with torch (optional)
    python tools/onnx_table.py --exported runs/onnx

Every model is planned with --add-loss (a SoftmaxWithLoss and a label input appended), batch
64 at its file's input size, static allocation, the fused update, as tools/gist_table.py
plans the Caffe models; no SSDC densities are measured for these files, so SSDC is planned
nowhere and `lossless` is Binarize and the max-pool codes alone.
"""
import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import minigist  # noqa: E402
from minigist.pipeline import Options, plan_report  # noqa: E402

MODES = (("none", "fp16"), ("lossless", "fp16"), ("lossy", "fp16"), ("all", "fp16"))


def light_models():
    """(name, path) of every model the installed onnx wheel ships under backend/test/data/light."""
    import onnx
    folder = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    return [(os.path.basename(p)[len("light_"):-len(".onnx")], p) for p in sorted(glob.glob(os.path.join(folder, "*.onnx")))]


def row(name, path, batch):
    cells = []
    base = None
    parameters = None
    for gist, dpr in MODES:
        options = Options(batch_size=batch, gist=gist, dpr=dpr, update="fused", add_loss=True)
        report = plan_report(path, options)
        parameters = report["parameters"]
        footprint = report["footprint_bytes"]
        base = base or footprint
        cells.append(f"{footprint / 2**30:.2f} ({base / footprint:.2f}x)")
    return f"| {name} | {parameters:,} | " + " | ".join(cells) + " |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exported", help="the folder tools/export_torchvision.py wrote")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"| model (batch {args.batch_size}) | parameters | none GiB | lossless | lossy fp16 | all fp16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, path in light_models():
        print(row(f"{name} (onnx wheel)", path, args.batch_size), flush=True)
    if args.exported:
        for path in sorted(glob.glob(os.path.join(args.exported, "*.onnx"))):
            name = os.path.basename(path)[:-len(".onnx")]
            print(row(f"{name} (torchvision)", path, args.batch_size), flush=True)
    print(f"\nminigist {minigist.__version__}; footprint GiB (ratio to none)")


if __name__ == "__main__":
    main()
