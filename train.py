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

This file parses the flags and prints; the run itself is minigist.trainer (Trainer, run).
"""
import argparse
import dataclasses
import functools
import os
import sys


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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# after the path tweak, so a checkout runs without installing
from minigist import jit  # noqa: E402
from minigist.backend import DEVICES  # noqa: E402
from minigist.checkpoint import CHECKPOINT_NAME, CONFIG_EXTRA_KEYS, RESUME_KEYS  # noqa: E402
from minigist.cli_args import (Parser, byte_size, config_checker, explicit_flags, fraction,  # noqa: E402
                               fraction_inclusive, join_negative_sizes, non_negative_float, non_negative_int,
                               positive_int, seed_int)
from minigist.codecs import DPR_FORMATS, GIST_MODES  # noqa: E402
from minigist.comm import DEFAULT_TIMEOUT, RankTimeoutError  # noqa: E402
from minigist.errors import MachineMemoryError, MemoryBudgetError, MinigistError  # noqa: E402
from minigist.memory.plan import MODES  # noqa: E402
from minigist.net import MAX_DEFAULT_THREADS  # noqa: E402
from minigist.passes.reduce import DEFAULT_BUCKET_BYTES, SHARDS  # noqa: E402
from minigist.pipeline import CONV_CHOICES, UPDATES  # noqa: E402
from minigist.trainer import (DEFAULT_DATA, DEFAULT_EPOCHS, DEFAULT_LR, DEFAULT_LR_GAMMA, DEFAULT_LR_STEP,  # noqa: E402
                              DEFAULT_MODEL, MODEL_LR, MODEL_WARMUP, RunOptions, Trainer, bundled_models,
                              optimize_hint)


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
  Run times and accuracies measured on real machines are in the README (Results).
"""


def bucket_size(text):
    try:
        return byte_size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 25MiB or 4MB, got {text!r}") from None


def microbatch_spec(text):
    """BLOB:SAMPLES -> (blob, samples); "auto" as it is."""
    if text == "auto":
        return text
    blob, _, samples = text.rpartition(":")
    if not blob or not samples.isdigit() or int(samples) < 1:
        raise argparse.ArgumentTypeError(f"expected BLOB:SAMPLES such as pool2:4, or auto, got {text!r}")
    return blob, int(samples)


def spans_spec(text):
    """START:THROUGH:SAMPLES[,START:THROUGH:SAMPLES...] -> ((start, through, samples), ...)."""
    spans = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(parts[:2]) or not parts[2].isdigit() or int(parts[2]) < 1:
            raise argparse.ArgumentTypeError(f"expected START:THROUGH:SAMPLES such as pool2:pool3:1 (several "
                                             f"separated by commas), got {text!r}")
        spans.append((parts[0], parts[1], int(parts[2])))
    return tuple(spans)


def positive_seconds(text):
    value = non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def make_parser():
    parser = Parser(prog="train.py", description="Train a model with minigist and report its memory footprint.",
                    epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("model and data")
    group.add_argument("--model", 
                       help=f"a bundled model ({', '.join(bundled_models())}), a Caffe .prototxt path or an "
                            f"ONNX .onnx path (needs pip install 'minigist[onnx]'; docs/onnx.md) "
                            f"(default {DEFAULT_MODEL})")
    group.add_argument("--data", metavar="NAME|FOLDER",
                       help=f"'{DEFAULT_DATA}' (bundled MNIST digits, the default), 'synthetic' (random "
                            f"images with learnable labels) or a folder FOLDER/CLASS_NAME/*.png|jpg")
    group.add_argument("--holdout", type=fraction, metavar="FRACTION",
                       help="fraction of every class held out for evaluation (default 0.2)")
    group.add_argument("--input-size", type=positive_int, metavar="PIXELS",
                       help="input height and width (default: the model file's, 32 for the small models)")
    group.add_argument("--batch-size", type=positive_int, help="images per step (default: the model file's)")
    group.add_argument("--add-loss", action="store_true",
                       help="append a SoftmaxWithLoss to a model file without a loss layer (a deploy file), "
                            "on the scores that feed its final Softmax (else on its last blob), with a label "
                            "input unless its data layer gives labels, and an Accuracy for evaluation; then "
                            "the file can be planned for training (--plan-only) and trained")
    group.add_argument("--ignore-initializers", action="store_true",
                       help="start an ONNX model from minigist's fillers (msra weights, zero biases, unit "
                            "BatchNorm scale and variance) instead of the weights its file gives")
    group.add_argument("--input-channels", type=positive_int, metavar="N",
                       help="input channels of a data layer whose file states none (Caffe's Data, "
                            "ImageData without is_color); default: the data's (1 for mnist5k and a "
                            "folder of gray images, 3 for a colour folder), else 3. A count the file "
                            "states (Input shapes, input_dim, MemoryData channels) wins; contradicting it "
                            "is an error")
    group.add_argument("--crop-pad", type=non_negative_int, metavar="PIXELS",
                       help="random-crop padding for training images, 0 for none (default: see below)")
    group.add_argument("--flip", choices=["auto", "on", "off"], 
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
    group.add_argument("--lr-step", type=non_negative_float, metavar="EPOCHS",
                       help="multiply the learning rate by --lr-gamma every EPOCHS epochs (fractions "
                            f"allowed; 0 keeps it constant; default {DEFAULT_LR_STEP:g})")
    group.add_argument("--lr-gamma", type=non_negative_float, metavar="G",
                       help=f"learning-rate factor at each step (default {DEFAULT_LR_GAMMA})")
    group.add_argument("--momentum", type=non_negative_float, help="SGD momentum (default 0.9)")
    group.add_argument("--weight-decay", type=non_negative_float, 
                       help="L2 weight decay (default 5e-4)")
    group.add_argument("--bn-average", type=fraction_inclusive, metavar="F",
                       help="moving_average_fraction of every BatchNorm layer: the weight of the old running "
                            "statistics that evaluation uses (default 0.9, about the last 10 batches; the "
                            "model files leave Caffe's 0.999, an average over ~1000 iterations that lags "
                            "far behind the weights in a short run: pass 0.999 for Caffe's behaviour)")
    group.add_argument("--seed", type=seed_int,
                       help="seed for weights, data order, augmentation and dropout (default 0)")
    group.add_argument("--threads", type=positive_int,
                       help="CPU threads of the steps: with --conv onednn oneDNN's OpenMP threads (numpy's "
                            "BLAS then runs on one), with im2col numpy's BLAS threads. Default: with oneDNN "
                            f"the CPUs this process may use (at most {MAX_DEFAULT_THREADS}; "
                            "OMP_NUM_THREADS if set), with im2col 1 (OPENBLAS_NUM_THREADS if set: on a small "
                            "machine shared with other work a multi-threaded BLAS spin-waits and can be many "
                            "times slower; oneDNN's OpenMP threads spin-wait too: there give --threads 1, or "
                            "OMP_WAIT_POLICY=passive, which keeps the results). Part of a checkpoint's "
                            "configuration: the float results depend on it")
    group.add_argument("--device", choices=list(DEVICES),
                       help="cpu, gpu (CuPy) or auto (GPU when one is usable); default cpu")
    group.add_argument("--conv", choices=list(CONV_CHOICES),
                       help="the CPU convolution engine: auto (the default: onednn where it is installed "
                            "and the run is float32 on the CPU, im2col otherwise), im2col (minigist's own, "
                            "numpy + BLAS: plans that do not depend on what is installed) or onednn "
                            "(oneDNN's direct kernels through ctypes, float32, faster: pip install "
                            "minigist[fast]). The engine chosen is printed (conv:), named in the report and "
                            "recorded in a checkpoint")
    group = parser.add_argument_group("memory")
    group.add_argument("--alloc", choices=list(MODES),
                       help="memory allocation: none (no sharing, the reference), static (planned "
                            "before running, in place where legal; the default) or dynamic (a pool "
                            "allocates as it runs)")
    group.add_argument("--gist", choices=list(GIST_MODES),
                       help="Gist encodings of the tensors stashed for the backward pass: none, "
                            "lossless (binarize ReLU/pool maps, sparse storage; exact training; the "
                            "default), lossy (reduced precision, --dpr) or all")
    group.add_argument("--dpr", choices=list(DPR_FORMATS),
                       help="the reduced-precision format of --gist lossy/all (default fp16)")
    group.add_argument("--update", choices=list(UPDATES) + ["auto"],
                       help="when each parameter's SGD update runs: fused (right after its layer's "
                            "backward, so weight gradients are freed as soon as they are applied and "
                            "share memory; the default), blocked (fused, and a fully connected layer's "
                            "weight gradient above 16 MiB made and applied a block of rows at a time), "
                            "separate (after the whole backward pass, as Caffe does; every gradient is live at "
                            "once), or with --optimize auto (the optimizer chooses fused or blocked, compared "
                            "with fused). Same weights bit for bit (blocked: on one BLAS thread)")
    group.add_argument("--microbatch", type=microbatch_spec, metavar="BLOB:SAMPLES|auto",
                       help="run the front of the net, from its input through top BLOB, SAMPLES samples at a "
                            "time: forward, and again in the backward pass before its backward, so none of its "
                            "feature maps, stashes or gradients is ever whole. Same weights bit for bit; the "
                            "front's forward runs twice. Convolutions (im2col), ReLU, pooling and LRN only; "
                            "SAMPLES divides the batch and is a whole number of each convolution's batch chunks. "
                            "auto (with --optimize): the optimizer chooses the front too, among the whole one and "
                            "one through each pooling layer at its smallest micro-batch")
    group.add_argument("--microbatch-span", type=spans_spec, metavar="START:THROUGH:SAMPLES[,...]",
                       help="run the layers after top START through top THROUGH SAMPLES samples at a time, forward "
                            "and backward, each micro-batch's stashes kept for its own backward (no replay): none "
                            "of the span's gradients is whole. Same weights bit for bit. The span's layers as for "
                            "--microbatch; START is read by the span alone. Several spans: separated by commas. "
                            "--microbatch auto (with --optimize) tries the span behind each front itself")
    group.add_argument("--memory-budget", type=byte_size, metavar="SIZE",
                       help="fail before training if it needs more memory than SIZE (e.g. 2GiB, 512MB)")
    group.add_argument("--optimize", action="store_true",
                       help="fit --memory-budget: choose for every stashed tensor between fp32, a lossless "
                            "encoding, DPR (--gist all, in the --dpr format) and recomputation, at the least "
                            "predicted step time, so that the exact static plan fits; prints the decisions "
                            "(--plan-only: from FLOPs and bytes at fixed reference rates, the same plan on every "
                            "machine; training: from a short profiling run). Without a budget, --plan-only "
                            "prints the frontier of footprint against predicted overhead (--plot draws it). "
                            "--gist lossless is the default; needs scipy (pip install 'minigist[optimize]')")
    group.add_argument("--measure-rates", action="store_true",
                       help="with --optimize --plan-only: measure this machine's GEMM rate and memory "
                            "bandwidth for the cost model (about a second) instead of the reference rates")
    group.add_argument("--densities", metavar="auto|none|FILE",
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
    group.add_argument("--checkpoint-every", type=non_negative_int, metavar="N",
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
    group.add_argument("--eval-every", type=non_negative_int, metavar="EPOCHS",
                       help="evaluate on the held-out split every EPOCHS epochs (default 1; 0: only at the "
                            "end; the end of the run is always evaluated)")
    group.add_argument("--train-eval-size", type=non_negative_int, metavar="N",
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
    group = parser.add_argument_group("many machines (MPI: mpiexec -n N python train.py ...; docs/distributed.md)")
    group.add_argument("--shard", choices=list(SHARDS),
                       help="what each rank keeps only its 1/N piece of, as ZeRO's stages: none (every rank "
                            "keeps everything, the default), optimizer (momentum), gradients (momentum and "
                            "the reduced gradients), weights (all three; a layer's weights are gathered around "
                            "its steps). The same weights bit for bit in every mode. Needs several ranks, or "
                            "--plan-only --ranks N")
    group.add_argument("--ranks", type=positive_int, metavar="N",
                       help="with --plan-only: the footprint of one of N ranks sharing --batch-size (the global "
                            "batch) (default: the processes an MPI launcher started, else 1)")
    group.add_argument("--bucket-size", type=bucket_size, metavar="SIZE",
                       help="gradients are summed across the ranks in buckets of at most SIZE (a larger "
                            "parameter alone in its own), each reduced as soon as its layers' backward steps "
                            f"are done (default {DEFAULT_BUCKET_BYTES // 2**20}MiB, as PyTorch's DDP)")
    group.add_argument("--rank-timeout", type=positive_seconds, metavar="SECONDS",
                       help="a rank that waits this long for the others (one died, hangs or stopped) ends the "
                            f"run with a one-line error (default {DEFAULT_TIMEOUT:g})")
    parser.set_defaults(**dataclasses.asdict(RunOptions()))     # the library's defaults are the flags'
    return parser


def main(argv=None):
    argv = join_negative_sizes(sys.argv[1:] if argv is None else list(argv))
    parser = make_parser()
    args = parser.parse_args(argv)
    jit.announce_compiles()     # a machine's first run compiles the kernels before its first line of progress
    trainer = Trainer(args, explicit_flags(make_parser, argv), command_line=argv,
                      out=functools.partial(print, flush=True),
                      check_config=config_checker(parser, RESUME_KEYS + CONFIG_EXTRA_KEYS),
                      environment_defaults=_SET_HERE)
    try:
        trainer.run()
        return 0
    except MachineMemoryError as exc:     # the machine is the limit: its message names the flags that change it
        return _error(trainer, str(exc))
    except MemoryBudgetError as exc:
        return _error(trainer, f"--memory-budget: {exc}{optimize_hint(trainer.args)}")
    except RankTimeoutError as exc:
        return _error(trainer, str(exc), every_rank=True)
    except MinigistError as exc:
        return _error(trainer, str(exc))
    except KeyboardInterrupt:
        if trainer.root:
            print(f"\ntrain.py: interrupted; {trainer.interrupted_note()}", file=sys.stderr)
        return _leave(trainer, 130, stuck=True)
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1


def _error(trainer, message, every_rank=False):
    """One line on stderr, exit status 2. In a data-parallel run every rank meets the same bad
    input and rank 0 alone says so; a rank that waited in vain for the others says it itself."""
    sys.stdout.flush()
    if trainer.root or every_rank:
        print(f"train.py: error: {' '.join(message.split())}", file=sys.stderr)
    return _leave(trainer, 2, every_rank)


def _leave(trainer, status, stuck):
    """The exit status; a rank that may have left a collective unfinished (`stuck`) exits at
    once, as MPI's finalization would wait for ranks that are gone, and its launcher stops
    the rest."""
    if stuck and trainer.comm is not None and trainer.comm.size > 1:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
