"""Train a bundled or user model with minigist.

    python train.py                                  # the default small model, synthetic data
    python train.py --model vgg16 --summary          # one row per layer, then `parameters: N`
    python train.py --model resnet20 --iters 50 --lr 0.05

Bad input (unknown model, wrong flag value, malformed model file) ends with a one-line
error and exit status 2.
"""
import argparse
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import minigist  # noqa: E402  (after the path tweak, so a checkout runs without installing)
from minigist.errors import MinigistError  # noqa: E402
from minigist.memory.plan import MODES  # noqa: E402
from minigist.memory.report import format_report, write_json  # noqa: E402
from minigist.net import plan_footprint  # noqa: E402

MODELS_DIR = os.path.join(HERE, "models")
DEFAULT_MODEL = "resnet20"


def bundled_models():
    return sorted(name[:-len(".prototxt")] for name in os.listdir(MODELS_DIR) if name.endswith(".prototxt"))


def resolve_model(name):
    """A bundled model name or a path to a .prototxt file."""
    if os.path.sep in name or name.endswith(".prototxt"):
        if not os.path.exists(name):
            raise MinigistError(f"--model: file not found: {name}")
        return name
    path = os.path.join(MODELS_DIR, name + ".prototxt")
    if not os.path.exists(path):
        raise MinigistError(f"--model: unknown model '{name}' (bundled: {', '.join(bundled_models())})")
    return path


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def byte_size(text):
    """'2GiB', '512MB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MB or 1e9, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit status 2, like every other bad-input error."""
        self.exit(2, f"train.py: error: {message}\n")


def make_parser():
    parser = Parser(description="Train a model with minigist and report its memory footprint.")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a bundled model name or a .prototxt path (default {DEFAULT_MODEL})")
    parser.add_argument("--data", default="synthetic", choices=["synthetic"],
                        help="training data: 'synthetic' (random images, labels learnable from them)")
    parser.add_argument("--batch-size", type=positive_int, help="images per step (default: the model file's)")
    parser.add_argument("--input-size", type=positive_int, help="input height and width (default: the model file's)")
    parser.add_argument("--iters", type=positive_int, default=30, help="training steps (default 30)")
    parser.add_argument("--lr", type=non_negative_float, default=0.01, help="base learning rate (default 0.01)")
    parser.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=5e-4, help="L2 weight decay (default 5e-4)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout (default 0)")
    parser.add_argument("--device", default="cpu", choices=list(minigist.backend.DEVICES),
                        help="cpu, gpu (CuPy) or auto (GPU when one is usable)")
    parser.add_argument("--alloc", default="static", choices=list(MODES),
                        help="memory allocation: none (no sharing, the reference), static (planned "
                             "before running, in place where legal) or dynamic (a pool allocates as it runs)")
    parser.add_argument("--memory-budget", type=byte_size, metavar="SIZE",
                        help="fail if training needs more memory than SIZE (e.g. 2GiB, 512MB)")
    parser.add_argument("--plan-only", action="store_true",
                        help="print the footprint report from shapes alone (nothing is allocated or run), then exit")
    parser.add_argument("--report-json", metavar="PATH", help="write the footprint report as JSON to PATH")
    parser.add_argument("--summary", action="store_true", help="print one row per layer and the parameter count, then exit")
    return parser


def synthetic_batches(shape, classes, seed):
    """Random images whose label is carried by a class-specific pattern, so loss can fall."""
    rng = np.random.default_rng(seed)
    patterns = rng.standard_normal((classes,) + tuple(shape[1:])).astype(np.float32)
    while True:
        labels = rng.integers(0, classes, size=shape[0])
        images = rng.standard_normal(shape).astype(np.float32) * 0.5 + patterns[labels]
        yield images, labels.astype(np.float32)


def run(args):
    path = resolve_model(args.model)
    if args.summary:
        graph = minigist.build_graph(path, "TRAIN", args.batch_size, args.input_size)
        print(minigist.summary(graph))
        return 0
    if args.plan_only:
        report = plan_footprint(path, args.batch_size, args.input_size, args.alloc)
        report["model"] = args.model
        if args.memory_budget is not None and report["footprint_bytes"] > args.memory_budget:
            raise MinigistError(f"--memory-budget: the {args.alloc} plan needs {report['footprint_bytes']:,} "
                                f"bytes, the budget allows {args.memory_budget:,} bytes")
        print(format_report(report))
        if args.report_json:
            write_json(report, args.report_json)
        return 0
    solver = minigist.SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    net = minigist.Net(path, batch_size=args.batch_size, input_size=args.input_size,
                       device=args.device, seed=args.seed, solver=solver, alloc=args.alloc,
                       memory_budget=args.memory_budget)
    graph = net.train_graph
    data_shape = (graph.batch_size,) + graph.input_shape
    classes = _class_count(net)
    print(f"model {args.model}: {graph.param_count():,} parameters, batch {data_shape}, "
          f"{classes} classes, device {args.device}, arena {net.arena_bytes / 2**20:.1f} MiB")
    batches = synthetic_batches(data_shape, classes, args.seed)
    start = time.perf_counter()
    for step in range(1, args.iters + 1):
        images, labels = next(batches)
        loss = net.train_step(images, labels)
        if not np.isfinite(loss):
            raise MinigistError(f"loss became {loss} at step {step}; lower --lr")
        if step == 1 or step % 10 == 0 or step == args.iters:
            rate = step * data_shape[0] / (time.perf_counter() - start)
            print(f"step {step:5d}  loss {loss:.4f}  {rate:.1f} images/s", flush=True)
    images, labels = next(batches)
    outputs = net.evaluate(images, labels)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in outputs.items() if isinstance(v, float))
    print(f"held-out synthetic batch: {shown}")
    report = net.report()
    report["model"] = args.model
    print(format_report(report))
    if args.report_json:
        write_json(report, args.report_json)
    return 0


def _class_count(net):
    """Number of classes: the channel count of the scores fed to the first loss layer."""
    for node in net.train_graph.nodes:
        if node.layer.is_loss:
            return int(node.layer.bottom_shapes[0][1])
    raise MinigistError(f"--model: {net.model} has no loss layer to train")


def main(argv=None):
    args = make_parser().parse_args(argv)
    try:
        return run(args)
    except MinigistError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("train.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
