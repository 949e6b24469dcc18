"""Train a bundled or user model with minigist and report its training memory footprint.

    python train.py                                  # ResNet-20 on the bundled MNIST digits
    python train.py --model vgg_small --epochs 2     # another bundled model
    python train.py --data path/to/folder            # your images: folder/CLASS_NAME/*.png|jpg
    python train.py --model vgg16 --plan-only        # the footprint from shapes alone, nothing runs
    python train.py --model vgg16 --summary          # one row per layer, then `parameters: N`
    python train.py --checkpoint ckpt --resume       # continue an interrupted run, bit for bit

Bad input (unknown model, bad flag value, a missing or inconsistent data folder, an unreadable
image, an input size the model cannot take, sizes beyond this machine's memory, a memory budget
too small, an unwritable output path, a damaged checkpoint) ends with a one-line error and exit
status 2; so does a loss that becomes NaN or infinite (the last checkpoint, every value in it
finite, is kept, with the command that resumes it at a lower learning rate).
"""
import argparse
import json
import math
import os
import re
import shlex
import sys
import time


_SET_HERE = set()    # the thread variables train.py put in the environment (not the user)


def _blas_threads(argv):
    """The --threads value, read before numpy loads: BLAS fixes its thread count at load time.
    None when it is not given (or not a positive integer: the parser reports that)."""
    value = None
    for index, arg in enumerate(argv):
        if arg == "--threads" and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
    return value if value is not None and value.isdigit() and int(value) > 0 else None


if __name__ == "__main__":
    _threads = _blas_threads(sys.argv[1:])
    if _threads is not None:
        for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[_name] = _threads
    else:
        # the default policy (minigist.net.default_threads) runs numpy's BLAS on one thread
        # unless the environment says otherwise; OpenBLAS starts its thread pool as it loads
        for _name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            if _name not in os.environ:
                os.environ[_name] = "1"
                _SET_HERE.add(_name)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import minigist  # noqa: E402  (after the path tweak, so a checkout runs without installing)
from minigist import blas, datasets, jit, onednn  # noqa: E402
from minigist.codecs import kernels as codec_kernels  # noqa: E402
from minigist.codecs import DPR_FORMATS, GIST_MODES, GistConfig  # noqa: E402
from minigist.densities import MARGIN, planned, read_densities  # noqa: E402
from minigist.checkpoint import arrays_digest, check_fields, model_change, model_definition, read_npz  # noqa: E402
from minigist.errors import MemoryBudgetError, MinigistError  # noqa: E402
from minigist.gist import apply_gist  # noqa: E402
from minigist.memory.available import check_fits  # noqa: E402
from minigist.memory.plan import MODES  # noqa: E402
from minigist.memory.report import format_report, write_json  # noqa: E402
from minigist.net import (MAX_DEFAULT_THREADS, UPDATES, default_threads, plan_footprint,  # noqa: E402
                          resolve_conv, save_npz_atomic, set_conv_engine)

MODELS_DIR = os.path.join(HERE, "models")
DENSITIES_DIR = os.path.join(MODELS_DIR, "densities")
DEFAULT_MODEL = "resnet20"
DEFAULT_DATA = "mnist5k"
DEFAULT_EPOCHS = 5
DEFAULT_LR = 0.1
# a bundled model's own default base learning rate where DEFAULT_LR does not suit it, as a
# Caffe model's solver.prototxt gives its base_lr: vgg_small has no BatchNorm and diverges
# at 0.1 within a few iterations on mnist5k and on folders
MODEL_LR = {"vgg_small": 0.01}
# and a linear warm-up (iterations) where its first full-size steps still blow it up (vgg_small:
# the loss jumps from 2.5 to 15.8 at step 2 at lr 0.01 and the net never recovers on a small folder)
MODEL_WARMUP = {"vgg_small": 100}
DEFAULT_LR_STEP = 1.0
DEFAULT_LR_GAMMA = 0.5
CHECKPOINT_NAME = "checkpoint.npz"
CHECKPOINT_FORMAT = 2     # 2: a digest of the arrays, the model's definition, the changes made on resumes



# ---- flag parsing -------------------------------------------------------------------------
def bundled_models():
    return sorted(name[:-len(".prototxt")] for name in os.listdir(MODELS_DIR) if name.endswith(".prototxt"))


def resolve_model(name):
    """A bundled model name or a path to a .prototxt file."""
    if os.path.sep in name or name.endswith(".prototxt"):
        if not os.path.isfile(name):
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


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def fraction_inclusive(text):
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def fraction(text):
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def byte_size(text):
    """'2GiB', '512MB', '1e9' -> bytes (a positive, finite number of them)."""
    match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MB or 1e9, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is too large to be a size")
    if value < 1:
        raise argparse.ArgumentTypeError(f"a memory budget must be positive (at least 1 byte), got {text!r}")
    return int(value)


def join_negative_sizes(argv):
    """`--memory-budget -5GB` as `--memory-budget=-5GB`: argparse would take -5GB for a flag
    and say the budget is missing, where the user meant a (wrong) negative size."""
    out = list(argv)
    for index in range(len(out) - 1):
        if out[index] == "--memory-budget" and re.match(r"-[0-9.]", out[index + 1]):
            out[index:index + 2] = [f"--memory-budget={out[index + 1]}", None]
    return [arg for arg in out if arg is not None]


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit status 2, like every other bad-input error."""
        self.exit(2, f"train.py: error: {' '.join(message.split())}\n")


HELP_EPILOG = f"""\
data: '{DEFAULT_DATA}' is 5,000 real MNIST digits bundled with minigist (no network needed);
  the held-out split is stratified: --holdout (20%) of every class, chosen with a fixed split
  seed (0) that does not change with --seed, i.e. 4,000 training / 1,000 held-out digits. The
  28x28 digits are zero-padded to 32x32 (resized for other input sizes) and given as 3
  identical channels to a 3-channel model. A folder is read as FOLDER/CLASS_NAME/IMAGE
  (.png .jpg .jpeg .bmp .gif .webp, decoded with Pillow): class names in sorted order are the
  labels; each image is converted to RGB (L for a 1-channel model), resized so that its
  shorter side fits the input size, and centre-cropped. Inputs are normalized per channel with
  the mean and standard deviation of the training split. 16-bit images are taken at their
  high byte, alpha is dropped (as Caffe's OpenCV reader does), a palette gives its colours;
  floating-point images and PNGs whose pixel data are cut short are refused. A folder with
  fewer classes than the model has outputs is trained with a warning; more is an error.
channels: a count the model file states wins (Input shapes, input_dim, MemoryData channels,
  ImageData is_color; --input-channels contradicting it is an error); Caffe's Data layer
  states none (its LMDB does): then --input-channels when given, else the data's own
  (mnist5k and a folder of gray images: 1, any colour image in the folder: 3), else 3 with
  a printed note. A 3-channel model gets gray images as three equal channels.
learning rate: a bundled model without BatchNorm that diverges at {DEFAULT_LR} has its own
  default, as a Caffe model ships a solver with its own base_lr ({', '.join(f'{m} {v:g}' for m, v in sorted(MODEL_LR.items()))});
  and, where its first full-size steps still blow it up, a linear warm-up over --warmup
  iterations (vgg_small 100). The other models start at the full rate. --lr and --warmup
  always win.
augmentation: a random crop of the zero-padded image (--crop-pad pixels: input size / 8 for
  folders; none by default for {DEFAULT_DATA}, where it slowed the short default run more than it
  helped, and for synthetic data) and a horizontal flip (--flip auto: on for folders, off for
  {DEFAULT_DATA} and synthetic data: a mirrored digit is another glyph).
batches: the net has a fixed batch size; the last training batch of an epoch is filled up
  with the first samples of that epoch's order; held-out evaluation pads its last batch and
  counts only the real samples, so its accuracy is exact.
checkpoints: --checkpoint DIR writes DIR/{CHECKPOINT_NAME} at every epoch end (and every
  --checkpoint-every iterations): weights, momentum, the data and dropout random generators,
  the position in the run and its configuration, written to a temporary file, synced and
  renamed over the previous one, so a run killed at any moment leaves a readable checkpoint.
  --resume continues from it; the final weights are bitwise those of an uninterrupted run.
  A checkpoint also holds a SHA-256 digest of its arrays and every layer's definition: a damaged
  file or an edited model file is refused on --resume (--allow-model-change accepts the edit).
  A new run into a DIR that holds a checkpoint is refused (--resume continues it, --overwrite
  replaces it); --resume with no checkpoint in DIR is an error (--resume-if-present starts from
  scratch then). Ctrl-C prints the iteration the checkpoint holds and the command that resumes it.
defaults: {DEFAULT_MODEL} on {DEFAULT_DATA}, batch 32 (the model file's), {DEFAULT_EPOCHS} epochs, lr
  {DEFAULT_LR} ({', '.join(f'{m} {v:g}' for m, v in sorted(MODEL_LR.items()))}) times {DEFAULT_LR_GAMMA} after every {DEFAULT_LR_STEP:g} epoch, momentum 0.9, weight decay 5e-4,
  BatchNorm average 0.9, Gist lossless, --conv auto with the threads that suit it (see --threads).
  Run times and accuracies measured on real machines are in the README (Command line, Performance).
"""


def make_parser():
    parser = Parser(description="Train a model with minigist and report its memory footprint.",
                    epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("model and data")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"a bundled model ({', '.join(bundled_models())}) or a .prototxt path "
                            f"(default {DEFAULT_MODEL})")
    group.add_argument("--data", default=DEFAULT_DATA, metavar="NAME|FOLDER",
                       help=f"'{DEFAULT_DATA}' (bundled MNIST digits, the default), 'synthetic' (random "
                            f"images with learnable labels) or a folder FOLDER/CLASS_NAME/*.png|jpg")
    group.add_argument("--holdout", type=fraction, default=0.2, metavar="FRACTION",
                       help="fraction of every class held out for evaluation (default 0.2)")
    group.add_argument("--input-size", type=positive_int, metavar="PIXELS",
                       help="input height and width (default: the model file's, 32 for the small models)")
    group.add_argument("--batch-size", type=positive_int, help="images per step (default: the model file's)")
    group.add_argument("--add-loss", action="store_true",
                       help="append a SoftmaxWithLoss to a model file without a loss layer (a deploy file), "
                            "on the scores that feed its final Softmax (else on its last blob), with a label "
                            "input unless its data layer gives labels, and an Accuracy for evaluation; then "
                            "the file can be planned for training (--plan-only) and trained")
    group.add_argument("--input-channels", type=positive_int, metavar="N",
                       help="input channels of a data layer whose file states none (Caffe's Data, "
                            "ImageData without is_color); default: the data's (1 for mnist5k and a "
                            "folder of gray images, 3 for a colour folder), else 3. A count the file "
                            "states (Input shapes, input_dim, MemoryData channels) wins; contradicting it "
                            "is an error")
    group.add_argument("--crop-pad", type=non_negative_int, metavar="PIXELS",
                       help="random-crop padding for training images, 0 for none (default: see below)")
    group.add_argument("--flip", choices=["auto", "on", "off"], default="auto",
                       help="random horizontal flips of training images (default auto: on for folders, "
                            f"off for {DEFAULT_DATA} and synthetic)")
    group = parser.add_argument_group("training")
    length = group.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=positive_int,
                        help=f"passes over the training split (default {DEFAULT_EPOCHS})")
    length.add_argument("--iters", type=positive_int, help="train this many iterations instead of whole epochs")
    group.add_argument("--lr", type=non_negative_float,
                       help=f"base learning rate (default {DEFAULT_LR}; a bundled model may have its own, as "
                            f"a Caffe solver's base_lr: "
                            f"{', '.join(f'{m} {v:g}' for m, v in sorted(MODEL_LR.items()))}; a given --lr "
                            f"always wins)")
    group.add_argument("--warmup", type=non_negative_int, metavar="ITERS",
                       help="raise the learning rate linearly from lr/ITERS to lr over the first ITERS "
                            "iterations (default 0; a bundled model may have its own: "
                            f"{', '.join(f'{m} {v}' for m, v in sorted(MODEL_WARMUP.items()))}; a given "
                            "--warmup always wins)")
    group.add_argument("--lr-step", type=non_negative_float, default=DEFAULT_LR_STEP, metavar="EPOCHS",
                       help="multiply the learning rate by --lr-gamma every EPOCHS epochs (fractions "
                            f"allowed; 0 keeps it constant; default {DEFAULT_LR_STEP:g})")
    group.add_argument("--lr-gamma", type=non_negative_float, default=DEFAULT_LR_GAMMA, metavar="G",
                       help=f"learning-rate factor at each step (default {DEFAULT_LR_GAMMA})")
    group.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD momentum (default 0.9)")
    group.add_argument("--weight-decay", type=non_negative_float, default=5e-4,
                       help="L2 weight decay (default 5e-4)")
    group.add_argument("--bn-average", type=fraction_inclusive, default=0.9, metavar="F",
                       help="moving_average_fraction of every BatchNorm layer: the weight of the old running "
                            "statistics that evaluation uses (default 0.9, about the last 10 batches; the "
                            "model files leave Caffe's 0.999, an average over ~1000 iterations that lags "
                            "far behind the weights in a short run: pass 0.999 for Caffe's behaviour)")
    group.add_argument("--seed", type=int, default=0,
                       help="seed for weights, data order, augmentation and dropout (default 0)")
    group.add_argument("--threads", type=positive_int,
                       help="CPU threads of the steps: with --conv onednn oneDNN's OpenMP threads (numpy's "
                            "BLAS then runs on one), with im2col numpy's BLAS threads. Default: with oneDNN "
                            f"the CPUs this process may use (at most {MAX_DEFAULT_THREADS}; "
                            "OMP_NUM_THREADS if set), with im2col 1 (OPENBLAS_NUM_THREADS if set: on a small "
                            "machine shared with other work a multi-threaded BLAS spin-waits and can be many "
                            "times slower). Part of a checkpoint's configuration: the float results depend on it")
    group.add_argument("--device", default="cpu", choices=list(minigist.backend.DEVICES),
                       help="cpu, gpu (CuPy) or auto (GPU when one is usable); default cpu")
    group.add_argument("--conv", default="auto", choices=list(minigist.CONV_CHOICES),
                       help="the CPU convolution engine: auto (the default: onednn where it is installed "
                            "and the run is float32 on the CPU, im2col otherwise), im2col (minigist's own, "
                            "numpy + BLAS: plans that do not depend on what is installed) or onednn "
                            "(oneDNN's direct kernels through ctypes, float32, faster: pip install "
                            "minigist[fast]). The engine chosen is printed (conv:), named in the report and "
                            "recorded in a checkpoint")
    group = parser.add_argument_group("memory")
    group.add_argument("--alloc", default="static", choices=list(MODES),
                       help="memory allocation: none (no sharing, the reference), static (planned "
                            "before running, in place where legal; the default) or dynamic (a pool "
                            "allocates as it runs)")
    group.add_argument("--gist", default="lossless", choices=list(GIST_MODES),
                       help="Gist encodings of the tensors stashed for the backward pass: none, "
                            "lossless (binarize ReLU/pool maps, sparse storage; exact training; the "
                            "default), lossy (reduced precision, --dpr) or all")
    group.add_argument("--dpr", default="fp16", choices=list(DPR_FORMATS),
                       help="the reduced-precision format of --gist lossy/all (default fp16)")
    group.add_argument("--update", default="fused", choices=list(UPDATES),
                       help="when each parameter's SGD update runs: fused (right after its layer's "
                            "backward, so weight gradients are freed as soon as they are applied and "
                            "share memory; the default) or separate (after the whole backward pass, "
                            "as Caffe does; every gradient is live at once). Same weights bit for bit")
    group.add_argument("--memory-budget", type=byte_size, metavar="SIZE",
                       help="fail before training if it needs more memory than SIZE (e.g. 2GiB, 512MB)")
    group.add_argument("--densities", default="auto", metavar="auto|none|FILE",
                       help="the SSDC densities a --plan-only plan assumes under --gist lossless/all (a plan "
                            "from shapes alone cannot see data): auto (the default) takes the bundled "
                            "measurement models/densities/NAME.json of a bundled model at its input size, "
                            "none plans SSDC nowhere, FILE is a measurement of yours "
                            "(tools/measure_densities.py writes one). Training measures them itself")
    group.add_argument("--plan-only", action="store_true",
                       help="print the footprint report from shapes alone (nothing is allocated or run), "
                            "write --report-json/--plot/--trace if asked, then exit")
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--checkpoint", metavar="DIR",
                       help=f"write DIR/{CHECKPOINT_NAME} atomically at each epoch end")
    group.add_argument("--checkpoint-every", type=non_negative_int, default=0, metavar="N",
                       help="also write it every N iterations (default 0: epoch ends only)")
    group.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint in --checkpoint DIR (its configuration is used "
                            "for the flags not given; --epochs/--iters may extend the run; --lr, --lr-step "
                            "and --lr-gamma may change the schedule, which then applies from the "
                            "checkpoint's iteration on, as Caffe applies a changed solver to a snapshot; "
                            "the change is recorded in the checkpoint). No checkpoint there is an error")
    group.add_argument("--resume-if-present", action="store_true",
                       help="resume when DIR holds a checkpoint, start from scratch when it does not "
                            "(for jobs that may be preempted and restarted with the same command)")
    group.add_argument("--overwrite", action="store_true",
                       help="start a new run in a --checkpoint DIR that holds a checkpoint, replacing it "
                            "(without this, a fresh run there is refused)")
    group.add_argument("--allow-model-change", action="store_true",
                       help="resume even though the model file changed since the checkpoint (refused "
                            "otherwise: the checkpoint records every layer's definition)")
    group = parser.add_argument_group("output")
    group.add_argument("--eval-every", type=non_negative_int, default=1, metavar="EPOCHS",
                       help="evaluate on the held-out split every EPOCHS epochs (default 1; 0: only at the "
                            "end; the end of the run is always evaluated)")
    group.add_argument("--train-eval-size", type=non_negative_int, default=1000, metavar="N",
                       help="training accuracy is measured in test mode on a fixed stratified sample "
                            "of N training images, every class in proportion, the same for every --seed "
                            "(default 1000; 0: not measured)")
    group.add_argument("--log", metavar="PATH",
                       help="write metrics as JSON lines (one object per iteration, epoch, checkpoint, end)")
    group.add_argument("--report-json", metavar="PATH", help="write the footprint report as JSON to PATH")
    group.add_argument("--plot", metavar="PATH",
                       help="draw the memory timeline (bytes live by category over the training "
                            "program's steps) as a PNG")
    group.add_argument("--trace", metavar="PATH",
                       help="write the buffer lifetimes as Chrome trace-event JSON (Perfetto, "
                            "chrome://tracing); 1 us = 1 program step")
    group.add_argument("--summary", action="store_true",
                       help="print one row per layer and the parameter count, then exit")
    return parser


_UNSET = object()


def explicit_flags(parser, argv):
    """The destinations the command line sets (as opposed to defaults)."""
    probe = make_parser()
    for action in probe._actions:
        if action.dest != "help":
            action.default = _UNSET
    values = vars(probe.parse_args(argv))
    return {dest for dest, value in values.items() if value is not _UNSET}


# ---- small helpers -------------------------------------------------------------------------
def _mib(nbytes):
    return f"{nbytes / 2**20:,.1f} MiB"


def _duration(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _class_count(graph, model):
    """Number of classes: the channel count of the scores fed to the first loss layer."""
    for node in graph.nodes:
        if node.layer.is_loss:
            return int(node.layer.bottom_shapes[0][1])
    raise MinigistError(f"--model: {model} has no loss layer to train (a deploy file?); --add-loss appends a "
                        f"SoftmaxWithLoss on its scores")


def _output_names(net):
    """(accuracy blob, loss blob) of the TEST program (None where there is none)."""
    accuracy = loss = None
    for node in net.graphs["TEST"].nodes:
        if node.layer.type == "Accuracy" and accuracy is None:
            accuracy = node.tops[0]
        elif node.layer.is_loss and loss is None:
            loss = node.tops[0]
    return accuracy, loss


def default_lr(model):
    """The base learning rate when --lr is not given: the bundled model's own, else DEFAULT_LR."""
    return MODEL_LR.get(model, DEFAULT_LR)


def input_channels_for(path, args, data_given):
    """The channel count to build the data layers with: --input-channels when given (the
    graph refuses it where the file states another), None where the file states every data
    layer's, else the data's own (`data_given`: --data is read), else 3 with a printed note."""
    if args.input_channels is not None:
        return args.input_channels
    graph = minigist.build_graph(path, "TRAIN", args.batch_size, args.input_size)
    if all(layer.channels_stated for layer in graph.layers if layer.is_data):
        return None
    native = datasets.native_channels(args.data) if data_given else None
    if native is None:
        why = f"--data {args.data} has none of its own" if data_given else "no --data given"
        print(f"input channels: 3 assumed ({args.model}'s data layer states no channel count and {why}; "
              f"set --input-channels)")
        return 3
    print(f"input channels: {native}, those of --data {args.data} ({args.model}'s data layer states none)")
    return native


def class_count_note(data, classes, data_name):
    """A warning when the data have fewer classes than the model has outputs (more are refused
    when the data are loaded)."""
    if data.classes < classes:
        return (f"warning: --data {data_name} has {data.classes} classes, the model predicts {classes}: "
                f"{classes - data.classes} outputs are never a label (use a model with {data.classes} outputs)")
    return None


def lr_at(args, iteration, iters_per_epoch):
    """The step schedule, lr * gamma ** floor(epochs done / lr_step), times a linear warm-up
    (iteration + 1) / warmup over the first --warmup iterations."""
    warmup = min(1.0, (iteration + 1) / args.warmup) if args.warmup else 1.0
    if not args.lr_step:
        return args.lr * warmup
    steps = math.floor(iteration / (args.lr_step * iters_per_epoch) + 1e-9)
    return args.lr * args.lr_gamma ** steps * warmup


def set_bn_average(net, fraction):
    """Set the moving_average_fraction of every BatchNorm layer (TRAIN updates the running
    statistics that TEST reads)."""
    for graph in net.graphs.values():
        for layer in graph.layers:
            if layer.type == "BatchNorm":
                if not hasattr(layer, "maf"):
                    raise MinigistError("--bn-average: this minigist's BatchNorm has no moving average "
                                        "fraction to set")
                layer.maf = float(fraction)


def rng_state(rng):
    """The generator's state as JSON-ready data (None where it has none: CuPy's generators)."""
    try:
        state = rng.bit_generator.state
        json.dumps(state)
        return state
    except (AttributeError, TypeError, ValueError):
        return None


def set_rng_state(rng, state):
    if state is not None:
        rng.bit_generator.state = state


class Log:
    """JSON lines: one object per event, flushed as written."""

    def __init__(self, path, append):
        self.out = None
        if path:
            try:
                self.out = open(path, "a" if append else "w", encoding="utf-8")
            except OSError as exc:
                raise MinigistError(f"--log: cannot write {path}: {exc.strerror}") from None

    def write(self, event, **fields):
        if self.out is None:
            return
        record = {"event": event, "time": round(time.time(), 3)}
        record.update(fields)
        self.out.write(json.dumps(record, default=_json_default) + "\n")
        self.out.flush()

    def close(self):
        if self.out is not None:
            self.out.close()


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value)}")


class Progress:
    """A live bar on stderr when it is a terminal, plain periodic lines on stdout otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_draw = 0.0
        self.shown = False

    def update(self, epoch, epochs, done, total, loss, rate, eta):
        if self.live:
            now = time.perf_counter()
            if now - self.last_draw < 0.1 and done < total:
                return
            self.last_draw = now
            width = 24
            filled = int(width * done / max(total, 1))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r\033[Kepoch {epoch}/{epochs} [{bar}] {done}/{total}  loss {loss:.4f}  "
                              f"{rate:,.0f} img/s  eta {_duration(eta)}")
            self.stream.flush()
            self.shown = True
        else:
            every = max(1, total // 5)
            if done == 1 or done % every == 0 or done == total:
                print(f"  epoch {epoch} iter {done}/{total}  loss {loss:.4f}  {rate:,.1f} img/s", flush=True)

    def clear(self):
        if self.live and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


# ---- checkpoints ---------------------------------------------------------------------------
def checkpoint_path(folder):
    return os.path.join(folder, CHECKPOINT_NAME)


def write_checkpoint(folder, state, meta, order):
    arrays = dict(state)
    arrays["__order__"] = np.asarray(order if order is not None else [], dtype=np.int64)
    meta = dict(meta, digest=arrays_digest(arrays))
    arrays["__meta__"] = np.frombuffer(json.dumps(meta, default=_json_default).encode("utf-8"), dtype=np.uint8)
    path = checkpoint_path(folder)
    try:
        save_npz_atomic(path, arrays)
    except OSError as exc:
        raise MinigistError(f"--checkpoint: cannot write {path}: {exc.strerror or exc}") from None
    return path


def remove_stale_temporaries(folder):
    """Temporary files a killed run left behind (the checkpoint itself is never partial)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(".tmp-") and name.endswith(".npz"):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


# what a checkpoint's metadata holds, key by key (minigist.checkpoint.check_fields)
META_SCHEMA = {"format": "int", "config": "dict", "data": "dict", "iteration": "count", "epoch": "count",
               "batch_in_epoch": "count", "data_rng": "dict?", "net_rng": "dict?", "history": "list",
               "epoch_losses": "list", "digest": "str", "model": "list", "changes": "list"}
CONFIG_EXTRA_KEYS = ("epochs", "iters", "alloc", "device")


def read_checkpoint(folder):
    """(meta dict, order array or None, {state key: array}) of DIR's checkpoint, or None if
    there is none. A damaged file, metadata that is not what this train.py writes, arrays that
    do not match their digest, or values that are not finite: one MinigistError naming the file."""
    path = checkpoint_path(folder)
    if not os.path.exists(path):
        return None
    values = read_npz(path, "--resume")
    try:
        meta = json.loads(values.pop("__meta__").tobytes().decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("the metadata is not an object")
        if meta.get("format") == CHECKPOINT_FORMAT:
            check_meta(meta)
    except (KeyError, ValueError, TypeError) as exc:
        raise MinigistError(f"--resume: {path} has damaged metadata ({exc})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise MinigistError(f"--resume: {path} has checkpoint format {meta.get('format')}, "
                            f"this train.py reads format {CHECKPOINT_FORMAT}")
    if "__order__" not in values or meta["digest"] != arrays_digest(values):
        raise MinigistError(f"--resume: {path} is damaged: its arrays do not match the digest written with them")
    order = values.pop("__order__")
    bad = next((key for key, value in values.items()
                if value.dtype.kind not in "fiub" or (value.dtype.kind == "f" and not np.all(np.isfinite(value)))), None)
    if bad is not None:
        raise MinigistError(f"--resume: {path}: '{bad}' holds NaN, infinite or non-numeric values; it cannot be "
                            f"resumed (start over with --overwrite and a lower --lr)")
    return meta, (order if order.size and order.ndim == 1 and order.dtype.kind == "i" else None), values


def check_meta(meta):
    """Raise ValueError naming the first field of a checkpoint's metadata that is missing or
    not of the kind (and range, for the configuration) this train.py writes."""
    check_fields(meta, META_SCHEMA, "the metadata")
    config = meta["config"]
    parser = make_parser()
    actions = {action.dest: action for action in parser._actions}
    check_fields(config, {key: "any?" for key in RESUME_KEYS + CONFIG_EXTRA_KEYS}, "the configuration")
    for key in RESUME_KEYS + CONFIG_EXTRA_KEYS:
        value, action = config[key], actions[key]
        if value is None and key in ("epochs", "iters", "input_size", "batch_size", "crop_pad"):
            continue
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"the configuration's {key} is {value!r}, not one of {', '.join(action.choices)}")
        if action.type is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"the configuration's {key} is {value!r}")
            try:
                action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise ValueError(f"the configuration's {key}: {exc}") from None
        elif isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ValueError(f"the configuration's {key} is {value!r}, not true or false")
        elif action.choices is None and not isinstance(value, str):
            raise ValueError(f"the configuration's {key} is {value!r}, not a string")
    for name in ("data_rng", "net_rng"):
        if meta[name] is not None:     # the bit generator's own check of its state
            np.random.default_rng(0).bit_generator.state = meta[name]
    if not all(isinstance(loss, (int, float)) and not isinstance(loss, bool) for loss in meta["epoch_losses"]):
        raise ValueError("the metadata's epoch_losses are not all numbers")
    if not all(isinstance(record, dict) for record in meta["history"] + meta["changes"]):
        raise ValueError("the metadata's history is not a list of objects")
    if not all(isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)
               for item in meta["model"]):
        raise ValueError("the metadata's model definition is not a list of [layer, definition] pairs")


def checkpoint_iteration(folder):
    """The iteration DIR's checkpoint holds (read from its metadata alone), or None."""
    try:
        with np.load(checkpoint_path(folder), allow_pickle=False) as stored:
            meta = json.loads(stored["__meta__"].tobytes().decode("utf-8"))
        iteration = meta["iteration"]
        return iteration if isinstance(iteration, int) else None
    except Exception:   # noqa: BLE001  (only a hint for a message: any damage means "unknown")
        return None


def resume_command(argv, lr=None):
    """The command that resumes this run: its own flags, with --resume instead of
    --overwrite / --resume-if-present (and --lr replaced where given)."""
    dropped = {"--overwrite", "--resume", "--resume-if-present"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in dropped or (lr is not None and arg.startswith("--lr=")):
            continue
        if lr is not None and arg == "--lr":
            skip = True
            continue
        out.append(arg)
    out.append("--resume")
    if lr is not None:
        out += ["--lr", f"{lr:g}"]
    return "python train.py " + " ".join(shlex.quote(arg) for arg in out)


def interrupted_note(args):
    """What Ctrl-C leaves: which iteration the checkpoint holds and the command that resumes it."""
    if not getattr(args, "checkpoint", None):
        return "no --checkpoint was given: nothing to resume"
    path = checkpoint_path(args.checkpoint)
    if not os.path.exists(path):
        return f"no checkpoint was written to {args.checkpoint} yet: nothing to resume"
    iteration = checkpoint_iteration(args.checkpoint)
    held = f"iteration {iteration}" if iteration is not None else "an unreadable checkpoint"
    if not getattr(args, "checkpoint_owned", False):
        return f"{path} still holds the earlier run's {held} (this run had not written one yet)"
    return f"{path} holds {held}; resume with: {resume_command(getattr(args, 'command_line', []))}"


def restore_state(net, values, path):
    targets = net.state()
    missing = [key for key in targets if key not in values]
    extra = [key for key in values if key not in targets]
    if missing or extra:
        names = ", ".join((missing or extra)[:3])
        raise MinigistError(f"--resume: {path} does not match the model ({'missing' if missing else 'unknown'} "
                            f"{names})")
    for key, value in values.items():
        if tuple(value.shape) != tuple(targets[key].shape):
            raise MinigistError(f"--resume: {path}: '{key}' has shape {value.shape}, the net needs "
                                f"{targets[key].shape}")
    net.restore(values)


# the configuration a checkpoint records; a resumed run takes it for the flags it does not give
RESUME_KEYS = ("model", "data", "holdout", "input_size", "batch_size", "crop_pad", "flip", "lr", "warmup", "lr_step",
               "lr_gamma", "momentum", "weight_decay", "bn_average", "seed", "gist", "dpr", "conv", "threads",
               "add_loss")


# what a resume may change: the learning-rate schedule (e.g. after a NaN loss)
RESUME_CHANGEABLE = ("lr", "warmup", "lr_step", "lr_gamma")


def apply_checkpoint_config(args, given, meta, folder):
    """Take the checkpoint's configuration for the flags not given; returns {key: [old, new]}
    for the schedule flags given with a new value (any other difference is refused)."""
    stored = meta["config"]
    changed = {}
    for key in RESUME_KEYS:
        if key not in stored or not hasattr(args, key):
            continue
        if key == "flip" and getattr(args, key) == "auto":
            given = given - {"flip"}
        if key in given and getattr(args, key) != stored[key]:
            if key in RESUME_CHANGEABLE:
                changed[key] = [stored[key], getattr(args, key)]
                continue
            flag = "--" + key.replace("_", "-")
            raise MinigistError(f"--resume: the checkpoint in {folder} was made with {flag} {stored[key]}, "
                                f"not {getattr(args, key)} (drop {flag} to continue with the checkpoint's)")
        setattr(args, key, stored[key])
    if "epochs" not in given and "iters" not in given:
        args.epochs, args.iters = stored.get("epochs"), stored.get("iters")
    return changed


def check_output_paths(args):
    """Every file the run will write, checked before anything runs: its folder exists, it is
    not a folder itself, and it can be written."""
    for flag, path in (("--report-json", args.report_json), ("--plot", args.plot), ("--trace", args.trace),
                       ("--log", args.log)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise MinigistError(f"{flag}: {path} is a folder; give a file name")
        if not os.path.isdir(folder):
            raise MinigistError(f"{flag}: cannot write {path}: the folder {folder} does not exist")
        if not os.access(path if os.path.exists(path) else folder, os.W_OK):
            raise MinigistError(f"{flag}: cannot write {path}: permission denied")


def prepare_checkpoint_folder(folder):
    """Create DIR (and its parents) now, so that an unusable one fails before training."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise MinigistError(f"--checkpoint: {folder} exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise MinigistError(f"--checkpoint: cannot create {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise MinigistError(f"--checkpoint: cannot write in {folder}: permission denied")


def check_fits_machine(graph, model):
    """Before the data and the arena: the training plan needs at least every parameter and the
    largest blob (float32); refuse in one line if even that is more than this machine has."""
    params = sum(math.prod(int(d) for d in p.shape) for layer in graph.layers for p in layer.params)
    largest = max((math.prod(int(d) for d in blob.shape) for blob in graph.blobs.values()), default=0)
    itemsize = np.dtype(np.float32).itemsize
    check_fits((params + largest) * itemsize,
               f"--model {model} at batch {graph.batch_size}, input {'x'.join(map(str, graph.input_shape))}: "
               f"training (its parameters and its largest feature map alone)", at_least=True)


# ---- evaluation ----------------------------------------------------------------------------
def evaluate(net, data, split, batch_size, names, limit=None):
    """Exact accuracy and loss over `split`: a padded last batch (copies of its first sample)
    is corrected by the outputs of a batch made only of that sample."""
    accuracy_key, loss_key = names
    totals = {}
    count = 0
    for images, labels, real in data.eval_batches(split, batch_size, limit):
        outputs = net.evaluate(images, labels)
        if real < batch_size:
            filler = net.evaluate(np.repeat(images[:1], batch_size, axis=0), np.repeat(labels[:1], batch_size))
        for key in (accuracy_key, loss_key):
            if key is None:
                continue
            value = outputs[key] * batch_size
            if real < batch_size:
                value -= filler[key] * (batch_size - real)
            totals[key] = totals.get(key, 0.0) + value
        count += real
    result = {"samples": count}
    if accuracy_key is not None and count:
        correct = int(round(totals[accuracy_key]))
        result["correct"] = correct
        result["accuracy"] = correct / count
    if loss_key is not None and count:
        result["loss"] = totals[loss_key] / count
    return result


# ---- engine and threads --------------------------------------------------------------------
def resolve_engine(args, given, resumed):
    """Settle --conv auto and the default --threads (the library's policy, minigist.net.
    default_threads) into the engine and count this run uses, which the report names and a
    checkpoint records; returns where the thread count came from, for the printed lines.
    BLAS's and oneDNN's float results depend on their thread counts: a resumed run takes the
    checkpoint's, so that it ends with the uninterrupted run's bits."""
    args.conv = resolve_conv(args.conv, minigist.get_xp(args.device))
    if "threads" in given:
        source = "--threads"
    elif resumed and args.threads is not None:
        source = "the checkpoint's --threads"
    else:
        args.threads = default_threads(args.conv)
        variable = "OMP_NUM_THREADS" if args.conv == "onednn" else "OPENBLAS_NUM_THREADS"
        from_environment = variable in os.environ and variable not in _SET_HERE
        source = f"{variable} in the environment" if from_environment else f"the default for --conv {args.conv}"
    if args.conv == "onednn":   # before any primitive is made: oneDNN sizes its scratchpads by it
        onednn.set_threads(args.threads)
    return source


def engine_lines(net, args, threads_from):
    """The conv: and blas: lines: the engine and the threads the steps run on, and why."""
    lines = []
    if args.conv == "onednn":
        lines.append(f"conv: onednn, {onednn.describe()}, {_count(net.omp_threads, 'OpenMP thread')} "
                     f"({threads_from})")
    else:
        why = f" (--conv auto: {onednn.describe()})" if args.conv_asked == "auto" and net.xp is np else ""
        lines.append(f"conv: im2col, minigist's own (numpy + BLAS){why}")
    if net.xp is np:
        blas_why = "--conv onednn: oneDNN's threads take the cores" if args.conv == "onednn" else threads_from
        lines.append(f"blas: {blas.describe(with_threads=False)}, {_count(net.blas_threads, 'thread')} during the steps "
                     f"({blas_why})")
    return lines


def _count(number, noun):
    return f"{number} {noun}{'' if number == 1 else 's'}"


# ---- reports, plots ------------------------------------------------------------------------
def gist_kwargs(args):
    return {"gist": args.gist, "dpr": args.dpr, "update": args.update, "conv": args.conv}


def plan_for(path, args, alloc=None, gist=None):
    """The footprint report from shapes alone, SSDC planned from the densities settled by
    `choose_densities` (none where it found none)."""
    return plan_footprint(path, args.batch_size, args.input_size, alloc or args.alloc,
                          gist=args.gist if gist is None else gist, dpr=args.dpr, update=args.update,
                          conv=args.conv, add_loss=args.add_loss, input_channels=args.input_channels,
                          ssdc_density=getattr(args, "ssdc_density", None))


def shapes_only_plan(path, args):
    """A MemoryPlan of the training program built from shapes alone (for --plan-only plots)."""
    from minigist.memory.plan import MemoryPlan
    graph = minigist.build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
                                 input_channels=args.input_channels)
    set_conv_engine([graph], args.conv)
    program = minigist.build_program(graph, train=True, fused_update=args.update == "fused")
    program = apply_gist(program, GistConfig(args.gist, args.dpr, ssdc_density=getattr(args, "ssdc_density", None)))
    return MemoryPlan(program, args.alloc)


def choose_densities(path, args):
    """Settle the SSDC densities a plan from shapes alone assumes (--densities): a file, none,
    or (auto) the bundled measurement models/densities/NAME.json of a bundled model when it was
    made at this input size. Sets args.ssdc_density; returns (source, the line to print)."""
    args.ssdc_density = None
    if args.gist not in ("lossless", "all"):
        return None, None
    graph = minigist.build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
                                 input_channels=args.input_channels)
    choice, source = args.densities, None
    if choice == "auto":
        bundled = os.path.join(DENSITIES_DIR, os.path.splitext(os.path.basename(path))[0] + ".json")
        if os.path.dirname(os.path.abspath(path)) == os.path.abspath(MODELS_DIR) and os.path.isfile(bundled):
            with open(bundled, encoding="utf-8") as handle:
                stated = json.load(handle).get("input_size")
            if stated == graph.input_shape[-1]:
                source = bundled
            else:
                why = f"the bundled measurement is for input size {stated}, not {graph.input_shape[-1]}"
        else:
            why = "no measurement is bundled for this model"
    elif choice != "none":
        source = choice
    if source is None:
        reason = why if choice == "auto" else "--densities none"
        return None, (f"densities: none ({reason}): SSDC is planned nowhere, so this plan keeps those maps in "
                      f"another encoding; train.py measures them when it trains, or pass --densities FILE")
    measured = read_densities(source, graph)
    args.ssdc_density = planned(measured)
    return source, (f"densities: {source} ({len(measured)} tensors measured; SSDC planned "
                    f"{MARGIN:.0%} above the densest sample)")


def write_visuals(args, plan, report):
    from minigist import visualize
    for flag, path, write, what in (("--plot", args.plot, visualize.plot_timeline, "memory timeline"),
                                    ("--trace", args.trace, visualize.write_trace, "buffer trace")):
        if not path:
            continue
        try:
            write(plan, report, path)
        except OSError as exc:
            raise MinigistError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None
        print(f"{what}: {path}")


def footprint_lines(path, args, report):
    """The footprint and what it would be without Gist / without any sharing."""
    lines = [f"footprint: {report['footprint_bytes']:,} B ({_mib(report['footprint_bytes'])}), "
             f"alloc {report['alloc']}, gist {args.gist}" + (f" ({args.dpr})" if args.gist in ("lossy", "all") else "")]
    if args.gist != "none":
        base = plan_for(path, args, gist="none")["footprint_bytes"]
        saved = base - report["footprint_bytes"]
        lines.append(f"without Gist:  {base:,} B ({_mib(base)}), alloc {report['alloc']}; Gist saves "
                     f"{saved:,} B ({100.0 * saved / base:.1f}%)")
    else:
        lines.append("without Gist:  the same (this run uses --gist none)")
    reference = plan_for(path, args, alloc="none", gist="none")["footprint_bytes"]
    lines.append(f"no sharing:    {reference:,} B ({_mib(reference)}), alloc none, no Gist (the reference "
                 f"a framework without a planner would need)")
    return lines


# ---- the run -------------------------------------------------------------------------------
def run(args, given):
    np.seterr(all="ignore")     # overflow shows up as a non-finite loss or weight, reported in one line
    check_output_paths(args)
    resume_flag = "--resume" if args.resume else "--resume-if-present"
    if (args.resume or args.resume_if_present) and not args.checkpoint:
        raise MinigistError(f"{resume_flag} needs --checkpoint DIR (the folder to resume from)")
    if args.overwrite and (args.resume or args.resume_if_present):
        raise MinigistError(f"--overwrite starts a new run: it cannot be combined with {resume_flag}")
    if args.checkpoint:
        if os.path.exists(args.checkpoint) and not os.path.isdir(args.checkpoint):
            raise MinigistError(f"--checkpoint: {args.checkpoint} exists and is not a folder")
        remove_stale_temporaries(args.checkpoint)
    present = bool(args.checkpoint) and os.path.exists(checkpoint_path(args.checkpoint))
    resumed = read_checkpoint(args.checkpoint) if (args.resume or args.resume_if_present) and present else None
    if args.resume and not present:
        raise MinigistError(f"--resume: no checkpoint in {args.checkpoint} ({checkpoint_path(args.checkpoint)} does "
                            f"not exist); check the folder, or pass --resume-if-present to start from scratch "
                            f"when there is none")
    if args.resume_if_present and not present:
        print(f"--resume-if-present: no checkpoint in {args.checkpoint} yet: starting from scratch")
    if present and resumed is None and not (args.overwrite or args.plan_only or args.summary):
        iteration = checkpoint_iteration(args.checkpoint)
        held = f" (iteration {iteration})" if iteration is not None else ""
        raise MinigistError(f"--checkpoint: {args.checkpoint} already holds a checkpoint{held}; pass --resume to "
                            f"continue it, or --overwrite to replace it with this new run's")
    args.checkpoint_owned = resumed is not None
    if args.conv == "auto":   # not a choice to hold against a checkpoint's engine
        given = given - {"conv"}
    schedule_change = {}
    if resumed is not None:
        schedule_change = apply_checkpoint_config(args, given, resumed[0], args.checkpoint)
    threads_from = resolve_engine(args, given, resumed is not None)
    if args.lr is None:
        args.lr = default_lr(args.model)
    if args.warmup is None:
        args.warmup = MODEL_WARMUP.get(args.model, 0)
    path = resolve_model(args.model)
    if args.summary or args.plan_only:
        args.input_channels = input_channels_for(path, args, "data" in given)
    if args.summary:
        graph = minigist.build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
                                     input_channels=args.input_channels)
        print(minigist.summary(graph))
        return 0
    if args.plan_only:
        densities_source, densities_line = choose_densities(path, args)
        report = plan_for(path, args)
        report["model"] = args.model
        report["densities"] = densities_source
        if args.memory_budget is not None and report["footprint_bytes"] > args.memory_budget:
            try:        # the same check as a training run's, with its largest buffers
                shapes_only_plan(path, args).check_budget(args.memory_budget)
            except MemoryBudgetError as exc:
                raise MinigistError(f"--memory-budget: {exc}") from None
            raise MinigistError(f"--memory-budget: the {args.alloc} plan needs {report['footprint_bytes']:,} "
                                f"bytes, the budget allows {args.memory_budget:,} bytes")
        print(format_report(report))
        if densities_line:
            print(densities_line)
        if args.report_json:
            write_json(report, args.report_json)
        if args.plot or args.trace:
            write_visuals(args, shapes_only_plan(path, args), report)
        return 0

    # the data first (from the graph's shapes), so that bad data fails before memory is allocated
    try:
        args.input_channels = input_channels_for(path, args, True)
        graph = minigist.build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
                                     input_channels=args.input_channels)
    except MinigistError as exc:
        if args.input_size is None:
            raise
        raise MinigistError(f"--input-size {args.input_size}: {args.model} cannot take it: {exc}") from None
    check_fits_machine(graph, args.model)
    model_now = model_definition(path)
    if resumed is not None:
        change = model_change(resumed[0]["model"], model_now)
        if change and not args.allow_model_change:
            raise MinigistError(f"--resume: {path} changed since the checkpoint in {args.checkpoint} was written: "
                                f"{change}; restore it, or pass --allow-model-change to resume with the edited model")
        if change:
            print(f"--allow-model-change: resuming with the edited model ({change})")
            schedule_change["model"] = change
    if args.checkpoint:
        prepare_checkpoint_folder(args.checkpoint)
    classes = _class_count(graph, args.model)
    try:
        data = datasets.load_dataset(args.data, tuple(graph.input_shape), classes, holdout=args.holdout,
                                     seed=args.seed)
    except MemoryError as exc:
        shape, dtype = getattr(exc, "shape", None), getattr(exc, "dtype", None)
        needed = f"{math.prod(shape) * dtype.itemsize:,} bytes for an array {shape}" if shape and dtype else "more"
        raise MinigistError(f"--data: the images of {args.data} at input {'x'.join(map(str, graph.input_shape))} "
                            f"need {needed}: more memory than this machine can give (a smaller --input-size)") from None
    note = class_count_note(data, classes, args.data)
    if note:
        print(note)
    solver = minigist.SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    # with SSDC in play the budget is checked after calibration, against the measured plan
    calibrates = args.gist in ("lossless", "all")
    net = minigist.Net(path, batch_size=args.batch_size, input_size=args.input_size, device=args.device,
                       seed=args.seed, solver=solver, alloc=args.alloc, threads=args.threads, input_channels=args.input_channels,
                       memory_budget=None if calibrates else args.memory_budget, add_loss=args.add_loss,
                       **gist_kwargs(args))
    if calibrates and args.memory_budget is not None and net.persistent_bytes > args.memory_budget:
        raise MinigistError(f"--memory-budget: the weights and optimizer state alone need {net.persistent_bytes:,} "
                            f"bytes, the budget allows {args.memory_budget:,} bytes")
    set_bn_average(net, args.bn_average)
    graph = net.train_graph
    batch = graph.batch_size
    # the batch size stays as given (None: each phase its file's), so that a resumed run
    # evaluates at the TEST phase's batch size as the first run did
    args.input_size = graph.input_shape[-1]
    if len(data.train) == 0:
        raise MinigistError(f"--data: {args.data} leaves no training images after the held-out split")
    if args.crop_pad is None:
        args.crop_pad = data.crop_pad_default
    flip = data.flip_default if args.flip == "auto" else args.flip == "on"
    args.flip = "on" if flip else "off"
    names = _output_names(net)
    ipe = data.iters_per_epoch(batch)
    if args.epochs is None and args.iters is None:
        args.epochs = DEFAULT_EPOCHS
    total = args.iters if args.iters is not None else args.epochs * ipe
    epochs_shown = math.ceil(total / ipe)

    data_rng = np.random.default_rng(args.seed)
    iteration, epoch, batch_in_epoch, order = 0, 0, 0, None
    history, changes = [], []
    if resumed is not None:
        meta, order, values = resumed
        if meta.get("data") != data.fingerprint():
            raise MinigistError(f"--resume: the data differ from the checkpoint's ({args.data}: "
                                f"{meta['data'].get('train')} training images then, {len(data.train)} now)")
        if meta["batch_in_epoch"] and (order is None or meta["batch_in_epoch"] >= ipe
                                       or not np.array_equal(np.sort(order), np.arange(len(data.train)))):
            raise MinigistError(f"--resume: {checkpoint_path(args.checkpoint)} is damaged: its epoch position "
                                f"({meta['batch_in_epoch']} batches) does not fit this data's epochs")
    # Gist's sparse encodings plan their size from a few measured batches (before any state is restored)
    measured_densities = None
    if calibrates:
        calib_rng = np.random.default_rng(args.seed + 7919)
        picks = [data.epoch_batch(calib_rng.permutation(len(data.train)), 0, batch) for _ in range(3)]
        net.calibrate([data.train_batch(p, calib_rng) for p in picks], margin=MARGIN)
        measured_densities = f"measured on {len(picks)} training batches"
    if calibrates and args.memory_budget is not None:
        net.set_memory_budget(args.memory_budget)
    if resumed is not None:
        restore_state(net, values, checkpoint_path(args.checkpoint))
        set_rng_state(data_rng, meta["data_rng"])
        set_rng_state(net.rng, meta["net_rng"])
        iteration, epoch, batch_in_epoch = meta["iteration"], meta["epoch"], meta["batch_in_epoch"]
        history = meta.get("history", [])
        changes = meta["changes"] + ([dict(schedule_change, iteration=iteration)] if schedule_change else [])
        resumed_losses = meta.get("epoch_losses", [])
        print(f"resumed from {checkpoint_path(args.checkpoint)}: iteration {iteration}, epoch {epoch}"
              + (f" + {batch_in_epoch} batches" if batch_in_epoch else ""))
        for key in RESUME_CHANGEABLE:
            if key in schedule_change:
                print(f"--{key.replace('_', '-')} {schedule_change[key][1]:g} from iteration {iteration} on "
                      f"(was {schedule_change[key][0]:g}; the schedule counts from iteration 0)")

    report = net.report()
    report["model"] = args.model
    report["densities"] = measured_densities
    config = {key: getattr(args, key, None) for key in RESUME_KEYS}
    config.update(epochs=args.epochs, iters=args.iters, alloc=args.alloc, device=args.device)
    print(f"model {args.model}: {graph.param_count():,} parameters, batch {(batch,) + tuple(graph.input_shape)}, "
          f"{classes} classes, device {args.device}, footprint {_mib(report['footprint_bytes'])} "
          f"({args.alloc}, gist {args.gist}, conv {net.conv})")
    if graph.added_loss:
        print(f"added loss: {graph.added_loss}")
    print(f"layers: {jit.describe(net.xp)}")
    for line in engine_lines(net, args, threads_from):
        print(line)
    if args.gist != "none":
        print(f"codecs: {codec_kernels.describe(net.xp)}")
    if measured_densities:
        print(f"densities: {measured_densities} (SSDC planned {MARGIN:.0%} above the densest sample)")
    schedule = f" x{args.lr_gamma:g} every {args.lr_step:g} epochs" if args.lr_step else ""
    schedule += f", warm-up {args.warmup} iterations" if args.warmup else ""
    print(f"data {data.describe()}; crop pad {args.crop_pad}, flip {args.flip}; {total} iterations "
          f"({ipe} per epoch), lr {args.lr:g}{schedule}")

    log = Log(args.log, append=resumed is not None)
    log.write("start", config=config, resumed_at=iteration, data=data.describe(),
              footprint_bytes=report["footprint_bytes"])
    progress = Progress()
    ckpt_info = {"path": None, "iteration": None}
    if resumed is not None:
        ckpt_info = {"path": checkpoint_path(args.checkpoint), "iteration": iteration}

    def kept_note():
        # every checkpoint written here, or resumed from, was checked to hold finite values only
        if not ckpt_info["path"]:
            return "; no checkpoint was written" if args.checkpoint else ""
        return (f"; the last checkpoint ({ckpt_info['path']}, iteration {ckpt_info['iteration']}) is kept, every "
                f"value in it finite; resume it with a lower learning rate: "
                f"{resume_command(getattr(args, 'command_line', []), lr=args.lr / 10)}")

    def save(order_now):
        if not args.checkpoint:
            return
        state = net.state()
        bad = next((key for key, value in state.items() if not np.all(np.isfinite(value))), None)
        if bad is not None:
            log.write("error", iteration=iteration, nonfinite=bad)
            raise MinigistError(f"'{bad}' became NaN or infinite at iteration {iteration} (lr {net.solver.lr:g}); "
                                f"training stopped; try a lower --lr{kept_note()}")
        meta = {"format": CHECKPOINT_FORMAT, "config": config, "data": data.fingerprint(),
                "iteration": iteration, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "data_rng": rng_state(data_rng), "net_rng": rng_state(net.rng), "history": history,
                "epoch_losses": epoch_losses if batch_in_epoch else [], "model": model_now, "changes": changes}
        written = write_checkpoint(args.checkpoint, state, meta, order_now if batch_in_epoch else None)
        args.checkpoint_owned = True
        ckpt_info.update(path=written, iteration=iteration)
        log.write("checkpoint", path=written, iteration=iteration, epoch=epoch)

    run_start = time.perf_counter()
    train_seconds = 0.0
    train_images = 0
    epoch_losses, epoch_images, epoch_seconds = (resumed_losses if resumed is not None else []), 0, 0.0
    last_eval = None
    train_sample = data.train_sample(args.train_eval_size) if args.train_eval_size else None
    eval_batch = net.graphs["TEST"].batch_size     # a Caffe file's TEST data layer may give its own
    while iteration < total:
        if batch_in_epoch == 0:
            order = data.epoch_order(data_rng)
            epoch_losses, epoch_images, epoch_seconds = [], 0, 0.0
        indices = data.epoch_batch(order, batch_in_epoch, batch)
        images, labels = data.train_batch(indices, data_rng, args.crop_pad, flip)
        lr = lr_at(args, iteration, ipe)
        net.solver.lr = lr
        tick = time.perf_counter()
        loss = net.train_step(images, labels)
        spent = time.perf_counter() - tick
        if not math.isfinite(loss):
            progress.clear()
            log.write("error", iteration=iteration + 1, loss=str(loss))
            raise MinigistError(f"loss became {loss} at iteration {iteration + 1} (epoch {epoch + 1}, lr {lr:g}); "
                                f"training stopped; try a lower --lr{kept_note()}")
        iteration += 1
        batch_in_epoch += 1
        train_seconds += spent
        train_images += batch
        epoch_seconds += spent
        epoch_images += batch
        epoch_losses.append(loss)
        rate = epoch_images / max(epoch_seconds, 1e-9)
        in_epoch_total = min(ipe, total - (iteration - batch_in_epoch))
        progress.update(epoch + 1, epochs_shown, batch_in_epoch, in_epoch_total, loss, rate,
                        (total - iteration) * batch / max(rate, 1e-9))
        log.write("iter", epoch=epoch + 1, iteration=iteration, loss=loss, lr=lr, images_per_s=round(rate, 2))
        epoch_done = batch_in_epoch == ipe
        run_done = iteration == total
        if not (epoch_done or run_done):
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                save(order)
            continue
        progress.clear()
        if epoch_done:
            epoch += 1
            batch_in_epoch = 0
        shown_epoch = epoch if epoch_done else epoch + 1
        record = {"epoch": shown_epoch, "iteration": iteration, "loss": float(np.mean(epoch_losses)), "lr": lr,
                  "images_per_s": round(epoch_images / max(epoch_seconds, 1e-9), 2)}
        if run_done or (args.eval_every and epoch_done and epoch % args.eval_every == 0):
            if args.train_eval_size:
                train_eval = evaluate(net, data, train_sample, eval_batch, names)
                record["train_accuracy"] = train_eval.get("accuracy")
            if len(data.heldout):
                last_eval = evaluate(net, data, data.heldout, eval_batch, names)
                record["heldout_accuracy"] = last_eval.get("accuracy")
                record["heldout_loss"] = last_eval.get("loss")
        current = net.report()
        record["footprint_bytes"] = current["footprint_bytes"]
        history.append(record)
        print(epoch_line(record, epochs_shown, epoch_done), flush=True)
        log.write("epoch", **record)
        if epoch_done or run_done:
            save(order)
    elapsed = time.perf_counter() - run_start

    if last_eval is None and len(data.heldout):
        last_eval = evaluate(net, data, data.heldout, eval_batch, names)
    report = net.report()
    report["model"] = args.model
    report["densities"] = measured_densities
    report["training"] = {"iterations": iteration, "epochs": round(iteration / ipe, 3), "seconds": round(elapsed, 2),
                          "train_images_per_s": round(train_images / max(train_seconds, 1e-9), 2),
                          "heldout": last_eval, "data": data.describe()}
    print()
    print(f"done: {iteration} iterations ({iteration / ipe:.2f} epochs) in {elapsed:.1f} s this run, "
          f"{train_images / max(train_seconds, 1e-9):,.1f} training images/s")
    if last_eval and "accuracy" in last_eval:
        print(f"held-out accuracy {last_eval['accuracy']:.4f} ({last_eval['correct']}/{last_eval['samples']}), "
              f"loss {last_eval.get('loss', float('nan')):.4f}; held-out split: {args.holdout:g} of every class of "
              f"{args.data}, fixed split seed 0")
    print(format_report(report))
    for line in footprint_lines(path, args, report):
        print(line)
    if ckpt_info["path"]:
        print(f"checkpoint: {ckpt_info['path']} (iteration {ckpt_info['iteration']})")
    if args.report_json:
        write_json(report, args.report_json)
    write_visuals(args, net.plans["train"], report)
    log.write("end", iterations=iteration, seconds=round(elapsed, 2), heldout=last_eval,
              footprint_bytes=report["footprint_bytes"])
    log.close()
    return 0


def epoch_line(record, epochs, complete):
    parts = [f"epoch {record['epoch']}/{epochs}" + ("" if complete else " (partial)"),
             f"loss {record['loss']:.4f}"]
    if record.get("train_accuracy") is not None:
        parts.append(f"train acc {record['train_accuracy']:.4f}")
    if record.get("heldout_accuracy") is not None:
        parts.append(f"held-out acc {record['heldout_accuracy']:.4f}")
    parts.append(f"{record['images_per_s']:,.1f} img/s")
    parts.append(f"footprint {_mib(record['footprint_bytes'])}")
    parts.append(f"lr {record['lr']:g}")
    return "  ".join(parts)


def main(argv=None):
    argv = join_negative_sizes(sys.argv[1:] if argv is None else list(argv))
    parser = make_parser()
    args = parser.parse_args(argv)
    args.command_line = argv
    args.conv_asked = args.conv
    given = explicit_flags(parser, argv)
    jit.announce_compiles()     # a machine's first run compiles the kernels before its first line of progress
    try:
        return run(args, given)
    except MemoryBudgetError as exc:
        sys.stdout.flush()
        print(f"train.py: error: --memory-budget: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except MinigistError as exc:
        sys.stdout.flush()
        print(f"train.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ntrain.py: interrupted; {interrupted_note(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
