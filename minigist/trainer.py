"""Training a model file as train.py does, from Python: `Trainer(options).run()` or
`run(model=..., iters=...)`. It holds the run's order of checks (checkpoint flags, engine,
shapes, data, calibration, memory budget), the learning-rate schedule, exact held-out
evaluation, the training loop with its checkpoints, and the lines and JSON log it writes.
Every line meant for a person goes through the `out` callback (print by default); errors are
MinigistError (bad input) or MemoryBudgetError, each one line.
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import shlex
import sys
import time

import numpy as np

from . import SGD, blas, datasets, distributed, jit, onednn     # SGD by its public name, wherever its module is
from .backend import get_xp
from .checkpoint import (CHECKPOINT_FORMAT, RESUME_CHANGEABLE, RESUME_KEYS, apply_checkpoint_config,
                         checkpoint_iteration, checkpoint_path, json_default, model_change, model_definition,
                         prepare_checkpoint_folder, read_checkpoint, remove_stale_temporaries, restore_state,
                         write_checkpoint)
from .codecs import kernels as codec_kernels
from .comm import DEFAULT_TIMEOUT, RankTimeoutError
from .densities import MARGIN, planned, read_densities
from .errors import MemoryBudgetError, MinigistError
from .graph import MODELS_DIR, build_graph
from .memory.available import available_bytes, check_fits
from .memory.report import format_report, write_json
from .net import Net, default_threads, summary
from .passes.reduce import DEFAULT_BUCKET_BYTES
from .pipeline import Options, compile, per_rank, plan_report, resolve_conv, split_batch

# the bundled model files sit next to train.py, at the top of a checkout
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


@dataclasses.dataclass
class RunOptions:
    """Every setting of a run, named as train.py's flags (--lr-step: lr_step), with their
    defaults. None: settled by the run (the model file's, the data's, or the model's own)."""
    model: str = DEFAULT_MODEL
    data: str = DEFAULT_DATA
    holdout: float = 0.2
    input_size: int | None = None
    batch_size: int | None = None
    add_loss: bool = False
    ignore_initializers: bool = False
    input_channels: int | None = None
    crop_pad: int | None = None
    flip: str = "auto"
    epochs: int | None = None
    iters: int | None = None
    lr: float | None = None
    warmup: int | None = None
    lr_step: float = DEFAULT_LR_STEP
    lr_gamma: float = DEFAULT_LR_GAMMA
    momentum: float = 0.9
    weight_decay: float = 5e-4
    bn_average: float = 0.9
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    conv: str = "auto"
    alloc: str = "static"
    gist: str = "lossless"
    dpr: str = "fp16"
    update: str = "fused"
    memory_budget: int | None = None
    densities: str = "auto"
    plan_only: bool = False
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_if_present: bool = False
    overwrite: bool = False
    allow_model_change: bool = False
    eval_every: int = 1
    train_eval_size: int = 1000
    log: str | None = None
    report_json: str | None = None
    plot: str | None = None
    trace: str | None = None
    summary: bool = False
    ranks: int | None = None
    shard: str = "none"
    bucket_size: int = DEFAULT_BUCKET_BYTES
    rank_timeout: float = DEFAULT_TIMEOUT
    microbatch: tuple = ()
    microbatch_span: tuple = ()     # ((START, THROUGH, SAMPLES), ...)
    optimize: bool = False
    measure_rates: bool = False


def bundled_models():
    """The names of the model files in models/."""
    return sorted(name[:-len(".prototxt")] for name in os.listdir(MODELS_DIR) if name.endswith(".prototxt"))


def resolve_model(name):
    """A bundled model name or a path to a .prototxt or .onnx file."""
    if os.path.isdir(name):
        raise MinigistError(f"--model: {name} is a folder; give a model file (.prototxt or .onnx) or a bundled name")
    if os.path.sep in name or name.endswith((".prototxt", ".onnx")):
        if not os.path.isfile(name):
            raise MinigistError(f"--model: file not found: {name}")
        return name
    path = os.path.join(MODELS_DIR, name + ".prototxt")
    if not os.path.exists(path):
        raise MinigistError(f"--model: unknown model '{name}' (bundled: {', '.join(bundled_models())})")
    return path


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


def input_channels_for(path, args, data_given, out=print):
    """The channel count to build the data layers with: --input-channels when given (the
    graph refuses it where the file states another), None where the file states every data
    layer's, else the data's own (`data_given`: --data is read), else 3 with a printed note."""
    if args.input_channels is not None:
        return args.input_channels
    graph = build_graph(path, "TRAIN", args.batch_size, args.input_size)
    if all(layer.channels_stated for layer in graph.layers if layer.is_data):
        return None
    native = datasets.native_channels(args.data) if data_given else None
    if native is None:
        why = f"--data {args.data} has none of its own" if data_given else "no --data given"
        out(f"input channels: 3 assumed ({args.model}'s data layer states no channel count and {why}; "
            f"set --input-channels)")
        return 3
    out(f"input channels: {native}, those of --data {args.data} ({args.model}'s data layer states none)")
    return native


def class_count_note(data, classes, data_name):
    """A warning when the data have fewer classes than the model has outputs (more are refused
    when the data are loaded)."""
    if data.classes < classes:
        noun = "class" if data.classes == 1 else "classes"
        return (f"warning: --data {data_name} has {data.classes} {noun}, the model predicts {classes}: "
                f"{classes - data.classes} outputs are never a label "
                f"(use a model with {_count(data.classes, 'output')})")
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
    """Put back a state rng_state gave (nothing where it gave None, or where it is another kind
    of generator's: Dropout's stream on a GPU is not numpy's, and a run resumed on the other
    device draws its masks from its own)."""
    if state is not None and state.get("bit_generator") == rng.bit_generator.state.get("bit_generator"):
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
        self.out.write(json.dumps(record, default=json_default) + "\n")
        self.out.flush()

    def close(self):
        if self.out is not None:
            self.out.close()


class Progress:
    """A live bar on stderr when it is a terminal, plain periodic lines through `out` otherwise."""

    def __init__(self, out=print, stream=None):
        self.out = out
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
                self.out(f"  epoch {epoch} iter {done}/{total}  loss {loss:.4f}  {rate:,.1f} img/s")

    def clear(self):
        if self.live and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


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
    # the script as it was started (python ../minigist/train.py), so that the line pastes as it is
    script = sys.argv[0] if os.path.basename(sys.argv[0]) == "train.py" else "train.py"
    return f"python {shlex.quote(script)} " + " ".join(shlex.quote(arg) for arg in out)


def _probe_writable(flag, path):
    """Open `path` for appending (an existing file is left as it is; a new one is removed
    again): permission bits alone miss places such as /proc, which refuse any new file."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise MinigistError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)


def optimize_hint(args):
    """What a budget too small for the plan asked for can try, where the run did not: --optimize."""
    if args.optimize or args.alloc != "static":
        return ""
    return "; --optimize fits a budget by keeping, encoding or recomputing each stashed map (docs/memory.md)"


def check_output_paths(args):
    """Every file the run will write, checked before anything runs: its folder exists, it is
    not a folder itself, and it can be written (and --log is refused where nothing trains)."""
    if args.summary:    # the layer table alone: a file or a plan asked for too would silently not come
        for flag, given in (("--report-json", args.report_json), ("--plot", args.plot), ("--trace", args.trace),
                            ("--optimize", args.optimize or None)):
            if given is not None:
                raise MinigistError(f"{flag}: --summary prints the layer table and nothing else (drop --summary "
                                    f"for the plan)")
    if args.log is not None and (args.plan_only or args.summary):
        raise MinigistError(f"--log: the metrics of a training run; {'--plan-only' if args.plan_only else '--summary'} "
                            f"trains nothing (--report-json writes the plan)")
    for flag, path in (("--report-json", args.report_json), ("--plot", args.plot), ("--trace", args.trace),
                       ("--log", args.log)):
        if path is None:
            continue
        if not path:
            raise MinigistError(f"{flag}: an empty file name")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise MinigistError(f"{flag}: {path} is a folder; give a file name")
        if not os.path.isdir(folder):
            what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
            raise MinigistError(f"{flag}: cannot write {path}: {folder} {what}")
        _probe_writable(flag, path)
        if flag == "--plot" and not path.lower().endswith(".png"):
            raise MinigistError(f"{flag}: {path}: the plot is written as PNG; give a name ending in .png")


def check_fits_machine(graph, model, budget=None):
    """Before the data and the arena: the training plan needs at least every parameter and the
    largest blob (float32); refuse in one line if even that is more than this machine has.
    Not where a --memory-budget (`budget`) below what the machine has is given: the plan's
    own check against it, later, says more (its largest buffers)."""
    free, _ = available_bytes()
    if budget is not None and free is not None and budget <= free:
        return
    params = sum(math.prod(int(d) for d in p.shape) for layer in graph.layers for p in layer.params)
    largest = max((math.prod(int(d) for d in blob.shape) for blob in graph.blobs.values()), default=0)
    itemsize = np.dtype(np.float32).itemsize
    check_fits((params + largest) * itemsize,
               f"--model {model} at batch {graph.batch_size}, input {'x'.join(map(str, graph.input_shape))}: "
               f"training (its parameters and its largest feature map alone)", at_least=True)


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


def resolve_engine(args, given, resumed, environment_defaults=frozenset()):
    """Settle --conv auto and the default --threads (the library's policy, minigist.net.
    default_threads) into the engine and count this run uses, which the report names and a
    checkpoint records; returns where the thread count came from, for the printed lines.
    BLAS's and oneDNN's float results depend on their thread counts: a resumed run takes the
    checkpoint's, so that it ends with the uninterrupted run's bits. `environment_defaults`:
    the thread variables the caller put in the environment itself, not the user."""
    args.conv = resolve_conv(args.conv, get_xp(args.device))
    if "threads" in given:
        source = "--threads"
    elif resumed and args.threads is not None:
        source = "the checkpoint's --threads"
    else:
        args.threads = distributed.threads_per_rank(default_threads(args.conv))
        variable = "OMP_NUM_THREADS" if args.conv == "onednn" else "OPENBLAS_NUM_THREADS"
        from_environment = variable in os.environ and variable not in environment_defaults
        source = f"{variable} in the environment" if from_environment else f"the default for --conv {args.conv}"
    if args.conv == "onednn":   # before any primitive is made: oneDNN sizes its scratchpads by it
        onednn.set_threads(args.threads)
    return source


def engine_lines(net, args, threads_from, conv_asked):
    """The conv: and blas: lines: the engine and the threads the steps run on, and why."""
    lines = []
    if args.conv == "onednn":
        lines.append(f"conv: onednn, {onednn.describe()}, {_count(net.omp_threads, 'OpenMP thread')} "
                     f"({threads_from})")
    else:
        why = f" (--conv auto: {onednn.describe()})" if conv_asked == "auto" and net.xp is np else ""
        lines.append(f"conv: im2col, minigist's own (numpy + BLAS){why}")
    if conv_asked == "checkpoint":
        lines[-1] += " (the checkpoint's engine)"
    if net.xp is np:
        blas_why = "--conv onednn: oneDNN's threads take the cores" if args.conv == "onednn" else threads_from
        lines.append(f"blas: {blas.describe(with_threads=False)}, {_count(net.blas_threads, 'thread')} "
                     f"during the steps ({blas_why})")
    return lines


def _count(number, noun):
    return f"{number} {noun}{'' if number == 1 else 's'}"


def gist_kwargs(args):
    """The Gist and engine settings Net takes, from the options."""
    return {"gist": args.gist, "dpr": args.dpr, "update": named_update(args), "conv": args.conv}


def compile_options(path, args, alloc=None, gist=None):
    """The pipeline's Options for a run's settings (SSDC planned from the densities settled by
    `choose_densities`, none where it found none): one rank's, where there are several."""
    return per_rank(path, Options(
        batch_size=args.batch_size, input_size=args.input_size, input_channels=args.input_channels, conv=args.conv,
        alloc=alloc or args.alloc, gist=args.gist if gist is None else gist, dpr=args.dpr, update=named_update(args),
        densities=getattr(args, "ssdc_density", None), add_loss=args.add_loss, ranks=getattr(args, "ranks", None) or 1,
        shard=getattr(args, "shard", "none"), bucket_bytes=getattr(args, "bucket_size", DEFAULT_BUCKET_BYTES),
        microbatch=named_front(args), spans=named_spans(args)))


def named_update(args):
    """--update as the pipeline takes it: "fused" for auto (the optimizer then chooses between
    it and "blocked", optimize.SettingsSearch, comparing with fused)."""
    return "fused" if args.update == "auto" else args.update


def named_front(args):
    """--microbatch as the pipeline takes it: (BLOB, SAMPLES), or () for none and for auto
    (the optimizer then chooses the front, optimize.SettingsSearch)."""
    front = getattr(args, "microbatch", None)
    return () if front in (None, "auto") else front


def named_spans(args):
    """--microbatch-span as the pipeline takes it: ((START, THROUGH, SAMPLES), ...)."""
    return tuple(tuple(span) for span in getattr(args, "microbatch_span", None) or ())


def plan_for(path, args, alloc=None, gist=None):
    """The footprint report from shapes alone."""
    return plan_report(path, compile_options(path, args, alloc, gist))


def shapes_only_plan(path, args):
    """The MemoryPlan of the training program, from shapes alone (for --plan-only plots)."""
    return compile(path, compile_options(path, args)).plan


def choose_densities(path, args):
    """Settle the SSDC densities a plan from shapes alone assumes (--densities): a file, none,
    or (auto) the bundled measurement models/densities/NAME.json of a bundled model when it was
    made at this input size. Sets args.ssdc_density; returns (source, the line to print)."""
    args.ssdc_density = None
    if args.gist not in ("lossless", "all"):
        return None, None
    graph = build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
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
        return None, (f"densities: none ({reason}): SSDC is planned nowhere, so this plan keeps those maps "
                      f"without it; train.py measures them when it trains, or pass --densities FILE")
    measured = read_densities(source, graph)
    args.ssdc_density = planned(measured)
    return source, (f"densities: {source} ({len(measured)} tensors measured; SSDC planned "
                    f"{MARGIN:.0%} above the densest sample)")


def write_visuals(args, plan, report, out=print):
    """The --plot and --trace files, each named in a line as it is written."""
    from . import visualize     # matplotlib loads only where a picture is asked for
    for flag, path, write, what in (("--plot", args.plot, visualize.plot_timeline, "memory timeline"),
                                    ("--trace", args.trace, visualize.write_trace, "buffer trace")):
        if not path:
            continue
        try:
            write(plan, report, path)
        except OSError as exc:
            raise MinigistError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None
        out(f"{what}: {path}")


def footprint_lines(path, args, report):
    """The footprint and what it would be without Gist / without any sharing."""
    lines = [f"footprint: {report['footprint_bytes']:,} B ({_mib(report['footprint_bytes'])}), "
             f"alloc {report['alloc']}, gist {args.gist}" + (f" ({args.dpr})" if args.gist in ("lossy", "all") else "")]
    if args.gist != "none":
        base = plan_for(path, args, gist="none")["footprint_bytes"]
        saved = base - report["footprint_bytes"]
        what = "the optimized plan" if args.optimize else "Gist"     # its recomputations too
        lines.append(f"without Gist:  {base:,} B ({_mib(base)}), alloc {report['alloc']}; {what} saves "
                     f"{saved:,} B ({100.0 * saved / base:.1f}%)")
    else:
        lines.append("without Gist:  the same (this run uses --gist none)")
    reference = plan_for(path, args, alloc="none", gist="none")["footprint_bytes"]
    lines.append(f"no sharing:    {reference:,} B ({_mib(reference)}), alloc none, no Gist (the reference "
                 f"a framework without a planner would need)")
    return lines


def epoch_line(record, epochs, complete):
    """The line printed at an epoch's end (or the run's, mid-epoch: "partial")."""
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


class Trainer:
    """One training run (or, with plan_only or summary, its plan or layer table).

    `options`: an RunOptions, or any object with its attributes (train.py passes its parsed
    flags); the run settles its None entries on a copy, `self.args`. `given`: the names of
    the settings the user chose, as opposed to defaults (a resume refuses to change those the
    checkpoint fixed, and takes its own for the others). `command_line`: train.py's argument
    list, for the resume command printed after an interruption or a NaN loss. `out`: called
    with every line meant for a person. `check_config(config)`: raises ValueError for a
    checkpoint's configuration value out of range (train.py checks them by its flags' rules).
    `environment_defaults`: the thread variables the caller put in the environment itself.
    `comm`: the ranks' communicator of a data-parallel run (minigist.comm); None: one process,
    or the MPI ranks a launcher started this process among (minigist.distributed). Rank 0
    prints, logs and writes the checkpoint.
    """

    def __init__(self, options, given=(), command_line=(), out=print, check_config=None,
                 environment_defaults=frozenset(), comm=None):
        self.args = copy.copy(options)
        for key in ("ranks", "shard", "bucket_size", "rank_timeout", "microbatch", "microbatch_span"):
            # an older caller's options
            if not hasattr(self.args, key):
                setattr(self.args, key, getattr(RunOptions, key))
        self.comm = comm
        self.root = True
        self.given = set(given)
        self.command_line = list(command_line)
        self.out = out
        self.check_config = check_config
        self.environment_defaults = frozenset(environment_defaults)
        self.conv_asked = options.conv
        self.checkpoint_owned = False

    def run(self):
        """Check everything, then print the layer table (summary), plan from shapes alone
        (plan_only) or train. Returns the footprint report (after training, with its
        "training" entry; None for summary); bad input raises MinigistError."""
        args = self.args
        np.seterr(all="ignore")     # overflow shows up as a non-finite loss or weight, reported in one line
        self._open_ranks()
        resumed = self._open_checkpoint()
        schedule_change, threads_from = self._settle_options(resumed)
        path = resolve_model(args.model)
        if args.microbatch == "auto" and named_spans(args):
            raise MinigistError("--microbatch-span: --microbatch auto chooses the spans with the front; give one or "
                                "the other")
        if args.optimize or args.measure_rates:
            from .optimize_cli import check_args
            check_args(args)
        elif args.microbatch == "auto":
            raise MinigistError("--microbatch auto: the optimizer chooses the front; give --optimize, or name one "
                                "as BLOB:SAMPLES")
        elif args.update == "auto":
            raise MinigistError("--update auto: the optimizer chooses between fused and blocked; give --optimize, or "
                                "name one")
        if args.summary or args.plan_only:
            if "data" in self.given:    # read by no step, but a path that names nothing is a mistake
                datasets.check_spec(args.data)
            args.input_channels = input_channels_for(path, args, "data" in self.given, self.out)
        if args.summary:
            self.out(summary(build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
                                         input_channels=args.input_channels)))
            return None
        if args.plan_only:
            if resumed is not None and resumed[0].get("optimizer") is not None:
                raise MinigistError(f"--plan-only: the checkpoint in {args.checkpoint} holds the plan its run fitted "
                                    f"with --optimize to the densities it measured; --resume trains with that plan, "
                                    f"where a plan from shapes alone would be another fit")
            return self._plan_only(path)
        return self._train(path, resumed, schedule_change, threads_from)

    def _open_ranks(self):
        """The ranks of a data-parallel run (minigist.distributed.open_ranks); only rank 0 speaks."""
        args = self.args
        if self.comm is None:
            self.comm = distributed.open_ranks(args, args.plan_only or args.summary)
        else:
            args.ranks = self.comm.size
        rank = self.comm.rank if self.comm is not None else distributed.launched_rank()
        self.root = rank == 0
        if not self.root:
            self.out = lambda *lines, **keywords: None

    def _open_checkpoint(self):
        """The flags' checks against the checkpoint folder, before anything else runs; returns
        the checkpoint to resume (read_checkpoint's triple) or None."""
        args, out = self.args, self.out
        check_output_paths(args)
        resume_flag = "--resume" if args.resume else "--resume-if-present"
        if (args.resume or args.resume_if_present) and not args.checkpoint:
            raise MinigistError(f"{resume_flag} needs --checkpoint DIR (the folder to resume from)")
        if args.checkpoint_every and not args.checkpoint:
            raise MinigistError("--checkpoint-every needs --checkpoint DIR (the folder to write them to)")
        if args.overwrite and (args.resume or args.resume_if_present):
            raise MinigistError(f"--overwrite starts a new run: it cannot be combined with {resume_flag}")
        if args.checkpoint:
            if os.path.exists(args.checkpoint) and not os.path.isdir(args.checkpoint):
                raise MinigistError(f"--checkpoint: {args.checkpoint} exists and is not a folder")
            if self.root:
                remove_stale_temporaries(args.checkpoint)
        present = bool(args.checkpoint) and os.path.exists(checkpoint_path(args.checkpoint))
        wanted = args.resume or args.resume_if_present
        resumed = read_checkpoint(args.checkpoint, self.check_config) if wanted and present else None
        if args.resume and not present:
            raise MinigistError(f"--resume: no checkpoint in {args.checkpoint} ({checkpoint_path(args.checkpoint)} "
                                f"does not exist); check the folder, or pass --resume-if-present to start from scratch "
                                f"when there is none")
        if args.resume_if_present and not present:
            out(f"--resume-if-present: no checkpoint in {args.checkpoint} yet: starting from scratch")
        if present and resumed is None and not (args.overwrite or args.plan_only or args.summary):
            iteration = checkpoint_iteration(args.checkpoint)
            held = f" (iteration {iteration})" if iteration is not None else ""
            raise MinigistError(f"--checkpoint: {args.checkpoint} already holds a checkpoint{held}; pass --resume to "
                                f"continue it, or --overwrite to replace it with this new run's")
        self.checkpoint_owned = resumed is not None
        return resumed

    def _settle_options(self, resumed):
        """Take a resumed checkpoint's configuration, settle the engine, threads, learning rate
        and warm-up; returns (the schedule changes this resume makes, where the threads came from)."""
        args, given = self.args, self.given
        if args.conv == "auto":   # not a choice to hold against a checkpoint's engine
            given = given - {"conv"}
        schedule_change = {}
        if resumed is not None:
            schedule_change = apply_checkpoint_config(args, given, resumed[0], args.checkpoint)
            if self.conv_asked == "auto" and args.conv != "auto":
                self.conv_asked = "checkpoint"      # the engine the checkpoint trained with, not a choice now
        threads_from = resolve_engine(args, given, resumed is not None, self.environment_defaults)
        if "dpr" in self.given and args.gist in ("none", "lossless"):
            self.out(f"note: --dpr {args.dpr} changes nothing under --gist {args.gist} (it is the format of "
                     f"--gist lossy and all)")
        if args.lr is None:
            args.lr = default_lr(args.model)
        if args.warmup is None:
            args.warmup = MODEL_WARMUP.get(args.model, 0)
        return schedule_change, threads_from

    def _plan_only(self, path):
        """The footprint report from shapes alone, checked against the memory budget, printed and written."""
        args, out = self.args, self.out
        densities_source, densities_line = choose_densities(path, args)
        if args.optimize:
            from .optimize_cli import plan_only
            if densities_line:
                out(densities_line)
            return plan_only(path, compile_options(path, args), args, out)
        report = plan_for(path, args)
        report["model"] = args.model
        report["densities"] = densities_source
        if args.memory_budget is not None and report["footprint_bytes"] > args.memory_budget:
            try:        # the same check as a training run's, with its largest buffers
                shapes_only_plan(path, args).check_budget(args.memory_budget)
            except MemoryBudgetError as exc:
                raise MinigistError(f"--memory-budget: {exc}{optimize_hint(args)}") from None
            raise MinigistError(f"--memory-budget: the {args.alloc} plan needs {report['footprint_bytes']:,} "
                                f"bytes, the budget allows {args.memory_budget:,} bytes{optimize_hint(args)}")
        report["memory_budget_bytes"] = args.memory_budget
        out(format_report(report))
        if densities_line:
            out(densities_line)
        if not self.root:
            return report
        if args.report_json:
            write_json(report, args.report_json)
        if args.plot or args.trace:
            write_visuals(args, shapes_only_plan(path, args), report, out)
        return report

    def _train(self, path, resumed, schedule_change, threads_from):
        """Data, net, calibration and budget, in that order (bad input fails before memory is
        allocated), then the training loop with its checkpoints, the final evaluation and report."""
        args, out = self.args, self.out
        # the data first (from the graph's shapes), so that bad data fails before memory is allocated
        try:
            args.input_channels = input_channels_for(path, args, True, out)
            graph = build_graph(path, "TRAIN", args.batch_size, args.input_size, add_loss=args.add_loss,
                                input_channels=args.input_channels)
            if args.ranks > 1:      # each rank's share of the global batch
                graph = build_graph(path, "TRAIN", split_batch(graph.batch_size, args.ranks), args.input_size,
                                    add_loss=args.add_loss, input_channels=args.input_channels)
        except MinigistError as exc:
            if args.input_size is None:
                raise
            raise MinigistError(f"--input-size {args.input_size}: {args.model} cannot take it: {exc}") from None
        check_fits_machine(graph, args.model, args.memory_budget)
        model_now = model_definition(path)
        if resumed is not None:
            change = model_change(resumed[0]["model"], model_now)
            if change and not args.allow_model_change:
                raise MinigistError(f"--resume: {path} changed since the checkpoint in {args.checkpoint} was written: "
                                    f"{change}; restore it, or pass --allow-model-change to resume with the edited "
                                    f"model")
            if change:
                out(f"--allow-model-change: resuming with the edited model ({change})")
                schedule_change["model"] = change
        if args.checkpoint and self.root:
            prepare_checkpoint_folder(args.checkpoint)
        classes = _class_count(graph, args.model)
        try:
            data = datasets.load_dataset(args.data, tuple(graph.input_shape), classes, holdout=args.holdout,
                                         seed=args.seed)
        except MemoryError as exc:
            shape, dtype = getattr(exc, "shape", None), getattr(exc, "dtype", None)
            needed = f"{math.prod(shape) * dtype.itemsize:,} bytes for an array {shape}" if shape and dtype else "more"
            raise MinigistError(f"--data: the images of {args.data} at input {'x'.join(map(str, graph.input_shape))} "
                                f"need {needed}: more memory than this machine can give (a smaller "
                                f"--input-size)") from None
        note = class_count_note(data, classes, args.data)
        if note:
            out(note)
        solver = SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        # with SSDC in play the budget is checked after calibration, against the measured plan
        calibrates = args.gist in ("lossless", "all")
        net = Net(path, batch_size=args.batch_size, input_size=args.input_size, device=args.device,
                  seed=args.seed, solver=solver, alloc=args.alloc, threads=args.threads,
                  input_channels=args.input_channels,
                  memory_budget=None if calibrates else args.memory_budget, add_loss=args.add_loss,
                  comm=self.comm, shard=args.shard, bucket_bytes=args.bucket_size, microbatch=named_front(args),
                  spans=named_spans(args), initializers=not args.ignore_initializers, **gist_kwargs(args))
        if calibrates and args.memory_budget is not None and net.persistent_bytes > args.memory_budget:
            raise MinigistError(f"--memory-budget: the weights and optimizer state alone need {net.persistent_bytes:,} "
                                f"bytes, the budget allows {args.memory_budget:,} bytes")
        set_bn_average(net, args.bn_average)
        graph = net.train_graph
        batch = graph.batch_size * args.ranks       # the global batch
        part = distributed.rank_part(self.comm, graph.batch_size)     # what this rank reads of it
        # the batch size stays as given (None: each phase its file's), so that a resumed run
        # evaluates at the TEST phase's batch size as the first run did
        args.input_size = graph.input_shape[-1]
        if len(data.train) == 0:
            raise MinigistError(f"--data: {args.data} leaves no training images after the held-out split")
        if args.crop_pad is None:
            args.crop_pad = data.crop_pad_default
        side = min(graph.input_shape[-2:])
        if args.crop_pad > side:
            raise MinigistError(f"--crop-pad: {args.crop_pad} pixels is more than the input's {side}: "
                                f"a crop shifted that far holds no image")
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
            calibration = [data.train_batch(p, calib_rng, part=part) for p in picks]
            net.calibrate(calibration, margin=MARGIN)
            measured_densities = f"measured on {len(picks)} training batches"
            if args.optimize and resumed is not None and resumed[0].get("optimizer") is not None:
                from .optimize_cli import restore_training_plan
                restore_training_plan(net, resumed[0]["optimizer"], out)
            elif args.optimize:     # the plan that fits the budget, chosen with the measured densities
                from .optimize_cli import fit_training_net
                fit_training_net(net, calibration[0], args, out)
        if calibrates and args.memory_budget is not None:
            net.set_memory_budget(args.memory_budget)
        if resumed is not None:
            restore_state(net, values, checkpoint_path(args.checkpoint))
            set_rng_state(data_rng, meta["data_rng"])
            set_rng_state(net.rng, distributed.rank_stream(meta, self.comm))
            iteration, epoch, batch_in_epoch = meta["iteration"], meta["epoch"], meta["batch_in_epoch"]
            history = meta.get("history", [])
            changes = meta["changes"] + ([dict(schedule_change, iteration=iteration)] if schedule_change else [])
            resumed_losses = meta.get("epoch_losses", [])
            out(f"resumed from {checkpoint_path(args.checkpoint)}: iteration {iteration}, epoch {epoch}"
                + (f" + {batch_in_epoch} batches" if batch_in_epoch else ""))
            for key in RESUME_CHANGEABLE:
                if key in schedule_change:
                    out(f"--{key.replace('_', '-')} {schedule_change[key][1]:g} from iteration {iteration} on "
                        f"(was {schedule_change[key][0]:g}; the schedule counts from iteration 0)")

        report = net.report()
        report["model"] = args.model
        report["densities"] = measured_densities
        config = {key: getattr(args, key, None) for key in RESUME_KEYS}
        config.update(epochs=args.epochs, iters=args.iters, alloc=args.alloc, device=args.device)
        out(f"model {args.model}: {graph.param_count():,} parameters, batch {(batch,) + tuple(graph.input_shape)}, "
            f"{classes} classes, device {args.device}, footprint {_mib(report['footprint_bytes'])} "
            f"({args.alloc}, gist {args.gist}, conv {net.conv})")
        if self.comm is not None:
            out(f"ranks: {self.comm.describe()}, {graph.batch_size} images each, shard {args.shard}; the footprint "
                f"is each rank's")
        if graph.added_loss:
            out(f"added loss: {graph.added_loss}")
        out(f"layers: {jit.describe(net.xp)}")
        for line in engine_lines(net, args, threads_from, self.conv_asked):
            out(line)
        if args.gist != "none":
            out(f"codecs: {codec_kernels.describe(net.xp)}")
        if measured_densities:
            out(f"densities: {measured_densities} (SSDC planned {MARGIN:.0%} above the densest sample)")
        schedule = f" x{args.lr_gamma:g} every {args.lr_step:g} epochs" if args.lr_step else ""
        schedule += f", warm-up {args.warmup} iterations" if args.warmup else ""
        out(f"data {data.describe()}; crop pad {args.crop_pad}, flip {args.flip}; {total} iterations "
            f"({ipe} per epoch), lr {args.lr:g}{schedule}")
        if resumed is not None and iteration >= total:
            out(f"the checkpoint holds iteration {iteration} of {total}: nothing is left to train "
                f"(a larger --epochs or --iters continues it)")

        log = Log(args.log if self.root else None, append=resumed is not None)
        resumed_at = iteration
        log.write("start", config=config, resumed_at=resumed_at, data=data.describe(),
                  footprint_bytes=report["footprint_bytes"])
        progress = Progress(out, stream=None if self.root else io.StringIO())
        ckpt_info = {"path": None, "iteration": None}
        if resumed is not None:
            ckpt_info = {"path": checkpoint_path(args.checkpoint), "iteration": iteration}

        def kept_note():
            # every checkpoint written here, or resumed from, was checked to hold finite values only
            if not ckpt_info["path"]:
                return "; no checkpoint was written" if args.checkpoint else ""
            return (f"; the last checkpoint ({ckpt_info['path']}, iteration {ckpt_info['iteration']}) is kept, every "
                    f"value in it finite; resume it with a lower learning rate: "
                    f"{resume_command(self.command_line, lr=args.lr / 10)}")

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
            if net.optimized is not None:   # a resume applies the same choices (no new fit)
                meta["optimizer"] = net.optimized.to_json()
            if self.comm is not None:       # the state is whole; each rank's Dropout stream is its own
                meta["distributed"] = distributed.checkpoint_entry(self.comm, args.shard, rng_state(net.rng))
                meta["net_rng"] = meta["distributed"]["net_rngs"][0]
            if not self.root:
                return
            written = write_checkpoint(args.checkpoint, state, meta, order_now if batch_in_epoch else None)
            self.checkpoint_owned = True
            ckpt_info.update(path=written, iteration=iteration)
            log.write("checkpoint", path=written, iteration=iteration, epoch=epoch)

        run_start = time.perf_counter()
        train_seconds = 0.0
        train_images = 0
        epoch_losses, epoch_images, epoch_seconds = (resumed_losses if resumed is not None else []), 0, 0.0
        last_eval = None
        train_sample = data.train_sample(args.train_eval_size) if args.train_eval_size else None
        if args.train_eval_size and args.train_eval_size > len(data.train.labels):
            out(f"training accuracy: on all {len(data.train.labels):,} training images (--train-eval-size "
                f"{args.train_eval_size:,} asks for more than the training split holds)")
        eval_batch = net.graphs["TEST"].batch_size     # a Caffe file's TEST data layer may give its own
        while iteration < total:
            if batch_in_epoch == 0:
                order = data.epoch_order(data_rng)
                epoch_losses, epoch_images, epoch_seconds = [], 0, 0.0
            indices = data.epoch_batch(order, batch_in_epoch, batch)
            images, labels = data.train_batch(indices, data_rng, args.crop_pad, flip, part=part)
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
                    train_eval = self._evaluate(net, data, train_sample, eval_batch, names)
                    record["train_accuracy"] = train_eval.get("accuracy")
                if len(data.heldout):
                    last_eval = self._evaluate(net, data, data.heldout, eval_batch, names)
                    record["heldout_accuracy"] = last_eval.get("accuracy")
                    record["heldout_loss"] = last_eval.get("loss")
            current = net.report()
            record["footprint_bytes"] = current["footprint_bytes"]
            history.append(record)
            out(epoch_line(record, epochs_shown, epoch_done))
            log.write("epoch", **record)
            if epoch_done or run_done:
                save(order)
        elapsed = time.perf_counter() - run_start

        if last_eval is None and len(data.heldout):
            last_eval = self._evaluate(net, data, data.heldout, eval_batch, names)
        if self.comm is not None:
            digest = distributed.same_state(net, self.comm)
            out(f"ranks: all {self.comm.size} hold the same weights and momentum, bit for bit (SHA-256 "
                f"{digest[:16]}...)")
        report = net.report()
        report["model"] = args.model
        report["densities"] = measured_densities
        report["memory_budget_bytes"] = args.memory_budget
        report["training"] = {"iterations": iteration, "epochs": round(iteration / ipe, 3),
                              "seconds": round(elapsed, 2),
                              "train_images_per_s": round(train_images / max(train_seconds, 1e-9), 2),
                              "heldout": last_eval, "data": data.describe()}
        out("")
        resumed_words = f"; resumed at {resumed_at}" if resumed_at else ""
        out(f"done: {iteration} iterations ({iteration / ipe:.2f} epochs{resumed_words}) in {elapsed:.1f} s this run, "
            f"{train_images / max(train_seconds, 1e-9):,.1f} training images/s")
        if last_eval and "accuracy" in last_eval:
            out(f"held-out accuracy {last_eval['accuracy']:.4f} ({last_eval['correct']}/{last_eval['samples']}), "
                f"loss {last_eval.get('loss', float('nan')):.4f}; held-out split: {args.holdout:g} of every class of "
                f"{args.data}, fixed split seed 0")
        out(format_report(report))
        for line in footprint_lines(path, args, report):
            out(line)
        if ckpt_info["path"]:
            out(f"checkpoint: {ckpt_info['path']} (iteration {ckpt_info['iteration']})")
        if args.report_json and self.root:
            write_json(report, args.report_json)
        if self.root:
            write_visuals(args, net.plans["train"], report, out)
        log.write("end", iterations=iteration, seconds=round(elapsed, 2), heldout=last_eval,
                  footprint_bytes=report["footprint_bytes"])
        log.close()
        return report

    def _evaluate(self, net, data, split, batch_size, names):
        """`evaluate`, over the ranks where there are several (minigist.distributed)."""
        if self.comm is None:
            return evaluate(net, data, split, batch_size, names)
        return distributed.evaluate_shared(evaluate, net, data, split, batch_size, names, self.comm)

    def interrupted_note(self):
        """What Ctrl-C leaves: which iteration the checkpoint holds and the command that resumes it."""
        folder = self.args.checkpoint
        if not folder:
            return "no --checkpoint was given: nothing to resume"
        path = checkpoint_path(folder)
        if not os.path.exists(path):
            return f"no checkpoint was written to {folder} yet: nothing to resume"
        iteration = checkpoint_iteration(folder)
        held = f"iteration {iteration}" if iteration is not None else "an unreadable checkpoint"
        if not self.checkpoint_owned:
            return f"{path} still holds the earlier run's {held} (this run had not written one yet)"
        return f"{path} holds {held}; resume with: {resume_command(self.command_line)}"


def run(out=print, **settings):
    """Train (or plan, or summarize) with the RunOptions fields given as keywords, the others at
    their defaults; returns Trainer.run's report."""
    return Trainer(RunOptions(**settings), given=settings, out=out).run()
