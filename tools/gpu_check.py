"""Verify minigist's whole GPU path on a machine with a CUDA device, in one call.

    PYTHONPATH=$PWD python3 tools/gpu_check.py [--out DIR] [--deadline 330] [--dry-run]

Installs nothing: it needs cupy, numpy, pytest and, for the comparison with torch's own step,
torch with CUDA (absent: that part is skipped with the reason). Sections, in order, each
written as it finishes to DIR/NN-name.json (DIR: --out, else $OUT, else gpu-check/):

 1. environment: versions, the device, every kernel of minigist/gpu/cuda_source.py compiled
    by CuPy (NVRTC) and loaded;
 2. pytest-gpu: the gpu-marked tests (python -m pytest -m gpu);
 3. codec-bytes: every codec's encode and decode on CuPy against numpy's bytes;
 4. layer-kernels: the MAX pooling, ReLU, BatchNorm and Scale kernels against their numpy code;
 5. dropout: the kept fraction, and the mask against its stream computed in numpy;
 6. training: vgg_small, resnet20, inception_small, 5 steps on the CPU and on the GPU under
    none, lossless, lossy, all: the first loss within 1e-5 relative, every later one within
    1e-3; lossless bit for bit like none on the GPU;
 7. recompute: the smallest lossless plan of minigist.optimize (encodings, shared and private
    recomputation) trained 3 steps on the GPU: bit for bit like none there;
 8. checkpoint: weights trained on the GPU, saved, loaded on the CPU: the same evaluation;
 9. pool-peak: the bytes CuPy's pool holds beyond the arena during a step
    (cupy.cuda.MemoryHook), against the plan: arena + peak <= plan + 1%;
10. timing: a step per Gist mode at batch 128 (all fp16 <= 1.05x of none) and torch's own
    step on the same net (cuDNN; minigist <= 1.5x on vgg_small and resnet20).

A section that would start past --deadline seconds is skipped with that reason; the last line
is `sections: P passed, F failed, S skipped` and the exit status is 1 when any failed.
--dry-run (no GPU needed, tests/test_gpu_check.py) runs the same structure on the CPU's
stand-in for cupy (minigist/gpu/rules.py) at small sizes where a section can run there, and
skips the others with the reason; its figures say nothing about a GPU.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from minigist.gpu import check, cuda_source, kernels as gpu_kernels  # noqa: E402

MODELS = ("vgg_small", "resnet20", "inception_small")
MODES = ("none", "lossless", "lossy", "all")
# The first loss is the forward pass alone: only float32 summation order separates the devices.
# Each SGD update feeds that difference back into the weights and the steps after it amplify it
# (resnet20 on an H200: 5e-7 at step 2, 5e-5 at step 4), so later losses are held to 1e-3.
FIRST_STEP_TOLERANCE = 1e-5
LATER_STEPS_TOLERANCE = 1e-3


class Sections:
    """Runs sections in order under a deadline, writing each one's JSON as it ends."""

    def __init__(self, out, deadline):
        self.out, self.deadline, self.start = out, deadline, time.perf_counter()
        self.results = []
        os.makedirs(out, exist_ok=True)

    def run(self, name, function, skip=None):
        elapsed = time.perf_counter() - self.start
        record = {"section": name, "started_s": round(elapsed, 1)}
        if skip:
            record.update(status="skipped", reason=skip)
        elif elapsed > self.deadline:
            record.update(status="skipped", reason=f"the deadline ({self.deadline:g} s) had passed")
        else:
            begin = time.perf_counter()
            try:
                passed, result = function()
                record.update(status="passed" if passed else "failed", result=result)
            except Exception as exc:        # noqa: BLE001 (a broken section is reported, the next ones run)
                record.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            record["seconds"] = round(time.perf_counter() - begin, 1)
        self.results.append(record)
        path = os.path.join(self.out, f"{len(self.results):02d}-{name}.json")
        with open(path, "w") as handle:
            json.dump(record, handle, indent=1, default=_json)
        print(f"{name}: {record['status']}" + (f" ({record.get('reason')})" if record.get("reason") else "")
              + (f" in {record['seconds']} s" if "seconds" in record else ""), flush=True)
        return record


def _json(value):
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def environment(cupy):
    info = {"python": platform.python_version(), "numpy": np.__version__}
    if cupy is None:
        return True, info
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    module = gpu_kernels.module(cupy)
    for name in cuda_source.KERNELS:
        module.get_function(name)
    info.update(cupy=cupy.__version__, device=props["name"].decode(), compute_capability=device.compute_capability,
                runtime=cupy.cuda.runtime.runtimeGetVersion(), driver=cupy.cuda.runtime.driverGetVersion(),
                kernels_loaded=len(cuda_source.KERNELS))
    return True, info


def pytest_gpu(deadline_left):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                             os.path.join(ROOT, "tests")], capture_output=True, text=True,
                            timeout=max(30, deadline_left), cwd=ROOT)
    tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
    return result.returncode == 0, {"returncode": result.returncode, "tail": tail}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    parser.add_argument("--deadline", type=float, default=330.0, help="seconds after which no section starts")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the structure, on the CPU's stand-in")
    parser.add_argument("--models", default=",".join(MODELS), help="bundled names or .prototxt paths")
    parser.add_argument("--batch-size", type=int, default=32, help="training, checkpoint and pool-peak batch")
    parser.add_argument("--timing-batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    cupy = torch = None
    if not args.dry_run:
        import minigist
        if not minigist.gpu_available():
            print("no CUDA device (cupy and a GPU): run with --dry-run to check the structure", file=sys.stderr)
            return 2
        import cupy
        try:
            import torch
            if not torch.cuda.is_available():
                torch = None
        except ImportError:
            torch = None
    xp = cupy if cupy is not None else __import__("minigist.gpu.rules", fromlist=["XP"]).XP
    device = "gpu" if cupy is not None else "cupy-rules"
    dry = args.dry_run
    models = tuple(args.models.split(","))
    if dry and args.models == ",".join(MODELS):
        models = ("resnet20",)
    steps, batch = (2, 2) if dry else (5, args.batch_size)
    sections = Sections(args.out, args.deadline)
    no_gpu = "needs a GPU (cupy.cuda)" if dry else None

    sections.run("environment", lambda: environment(cupy))
    sections.run("pytest-gpu", lambda: pytest_gpu(args.deadline - (time.perf_counter() - sections.start)),
                 skip="the gpu-marked tests skip without a GPU" if dry else None)

    def codec_bytes():
        rows = check.codec_bytes(xp)
        return all(r["same"] for r in rows), rows
    sections.run("codec-bytes", codec_bytes)

    def layer_kernels():
        rows = check.layer_kernels(cupy)
        return all(r["same"] for r in rows), rows
    sections.run("layer-kernels", layer_kernels, skip=no_gpu)

    def dropout():
        result = check.dropout_fraction(xp, count=1 << (14 if dry else 22))
        ok = abs(result["kept"] - result["expected"]) < (0.02 if dry else 0.002) and result["matches_numpy_stream"]
        return ok and result["scaled"], result

    sections.run("dropout", dropout)

    def training():
        results = [check.train_cpu_and_gpu(model, steps=steps, batch_size=batch, modes=MODES[:2] if dry else MODES,
                                           device=device) for model in models]
        ok = all(r["first_relative_difference"] <= FIRST_STEP_TOLERANCE
                 and r["worst_relative_difference"] <= LATER_STEPS_TOLERANCE
                 and r["lossless_bit_identical_on_gpu"] for r in results)
        return ok, results
    sections.run("training", training)

    def recompute():
        results = [check.optimized_training(model, steps=min(steps, 3), batch_size=batch, device=device)
                   for model in models]
        ok = all(r["bit_identical"] and any(c.startswith("recompute") for c in r["choices"]) for r in results)
        return ok, results
    sections.run("recompute", recompute)

    def checkpoint():
        with tempfile.TemporaryDirectory() as folder:
            result = check.checkpoint_to_cpu(models[0], folder, device=device, batch_size=batch)
        worst = max(result["max_abs_difference"].values())
        return worst <= 1e-4 and result["state_keys_equal"], result
    sections.run("checkpoint", checkpoint)

    def pool_peak():
        results = [check.pool_peak(model, gist, batch, cupy) for model in models for gist in ("none", "all")]
        return all(r["ratio_to_plan"] <= 1.01 for r in results), results
    sections.run("pool-peak", pool_peak, skip=no_gpu)

    def timing():
        results = [check.time_steps(model, args.timing_batch_size, ("none", "all"), args.repeats, cupy, torch)
                   for model in models]
        ok = all(r["ratio_to_none"]["all"] <= 1.05 for r in results)
        ok = ok and all(r.get("ratio_to_torch", 0) <= 1.5 for r in results if r["model"] in ("vgg_small", "resnet20"))
        return ok, results
    sections.run("timing", timing, skip=no_gpu)

    counts = {status: sum(r["status"] == status for r in sections.results)
              for status in ("passed", "failed", "error", "skipped")}
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"dry_run": dry, "sections": [{k: r[k] for k in ("section", "status") if k in r}
                                                for r in sections.results],
                   "seconds": round(time.perf_counter() - sections.start, 1)}, handle, indent=1)
    print(f"sections: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
          f"{counts['skipped']} skipped")
    return 1 if counts["failed"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
