"""Where a training step's time goes on the GPU: every step of the program timed on the device.

    PYTHONPATH=$PWD python3 tools/gpu_profile.py --models vgg_small,inception_small --gist none,all

Per model and Gist mode: the step's time on the device (CUDA events around every step of the
program, one synchronisation at the end) and on the host (the time Python took to enqueue
it), the median over --repeats steps, then the --top slowest steps and the time per step kind
and layer type. Device time close to host time means the GPU waits for the host's launches.
--device cpu (or cupy-rules) runs the same loop where no GPU is, timed on the host only.
--host-profile N adds, per model and mode, the N functions the host spent longest in over
--repeats whole train_step calls (cProfile, own time), which names a host-bound step's cause.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from minigist.costmodel import signature  # noqa: E402
from minigist.gpu.check import MODELS_DIR, _batches  # noqa: E402


def profile(model, gist, batch_size, repeats, device):
    """{signature: (device ms, host ms)} medians over `repeats` steps, and the label of each."""
    from minigist.net import Net
    path = model if model.endswith(".prototxt") else os.path.join(MODELS_DIR, model + ".prototxt")
    net = Net(path, batch_size=batch_size, device=device, gist=gist, conv="im2col", update="fused", seed=0)
    batches = _batches(net, 2)
    if net.gist.lossless:
        net.calibrate([batches[0]])
    for b in batches:
        net.train_step(*b)
    cupy = __import__("cupy") if device == "gpu" else None
    executor, program = net.executors["train"], net.compiled["train"].program
    device_ms, host_ms, labels, groups = {}, {}, {}, {}
    for run in range(repeats):
        executor.load(net._feeder("train", batches[run % 2]))
        events = [cupy.cuda.Event() for _ in range(len(program.steps) + 1)] if cupy else None
        host = []
        if cupy:
            events[0].record()
        for k, (step, bound) in enumerate(zip(program.steps, executor.steps)):
            tick = time.perf_counter()
            bound()
            host.append(time.perf_counter() - tick)
            if cupy:
                events[k + 1].record()
        if cupy:
            events[-1].synchronize()
        for k, step in enumerate(program.steps):
            key = signature(step)
            labels[key] = step.label
            groups[key] = f"{step.kind} " + (type(step.layer).__name__ if step.layer is not None
                                             else type(step.op).__name__ if step.op is not None else "-")
            spent = cupy.cuda.get_elapsed_time(events[k], events[k + 1]) if cupy else host[k] * 1e3
            device_ms.setdefault(key, []).append(spent)
            host_ms.setdefault(key, []).append(host[k] * 1e3)
    times = {key: (statistics.median(device_ms[key]), statistics.median(host_ms[key])) for key in device_ms}
    return times, labels, groups, (net, batches)


def host_profile(net, batches, repeats, top):
    """The `top` lines of cProfile's own-time table over `repeats` train steps."""
    profiler = cProfile.Profile()
    profiler.enable()
    for run in range(repeats):
        net.train_step(*batches[run % 2])
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg_small,resnet20,inception_small")
    parser.add_argument("--gist", default="none,all")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N")
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu", "cupy-rules"))
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        for gist in args.gist.split(","):
            times, labels, groups, (net, batches) = profile(model, gist, args.batch_size, args.repeats, args.device)
            total_device = sum(d for d, _ in times.values())
            total_host = sum(h for _, h in times.values())
            print(f"{model} {gist} batch {args.batch_size}: device {total_device:.2f} ms, "
                  f"host {total_host:.2f} ms, {len(times)} steps")
            by_op = {}
            for key, (d, h) in times.items():
                spent = by_op.setdefault(groups[key], [0.0, 0.0, 0])
                spent[0] += d
                spent[1] += h
                spent[2] += 1
            for group, (d, h, count) in sorted(by_op.items(), key=lambda item: -item[1][0])[:args.top]:
                print(f"  {group:<40} x{count:<4} device {d:8.2f} ms  host {h:8.2f} ms")
            for key, (d, h) in sorted(times.items(), key=lambda item: -item[1][0])[:args.top]:
                print(f"    {labels[key][:60]:<60} device {d:8.3f} ms  host {h:8.3f} ms")
            if args.host_profile:
                for line in host_profile(net, batches, args.repeats, args.host_profile):
                    print("      " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
