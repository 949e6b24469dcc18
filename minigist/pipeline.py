"""The one pipeline: model file -> graph -> passes -> plan, shared by Net, plan-only reports
and train.py.

    compiled = compile("models/resnet20.prototxt", Options(batch_size=32, gist="lossless"))
    compiled.plan.footprint_bytes       # exact, before anything is allocated

`compile` builds the graph of one phase (or takes one already built), runs the passes in
order (passes/backward.py, then for training passes/recompute.py and passes/gist.py, then
passes/inplace.py and passes/reduce.py) and
plans the program's memory. Options is frozen: a changed setting (densities measured by a
calibration, a new budget) is a new Options, and a new compile.
"""
from dataclasses import dataclass, field, replace

import numpy as np

from . import onednn
from .backend import get_xp, is_gpu
from .codecs import GistConfig
from .errors import MinigistError
from .graph import build_graph
from .layers.conv import Convolution
from .memory.plan import MODES, MemoryPlan
from .memory.report import footprint_report
from .passes.backward import build_program
from .passes.gist import apply_gist
from .passes.inplace import mark_inplace
from .passes.microbatch import apply_microbatch, apply_span, check_samples
from .passes.recompute import apply_recompute
from .passes.reduce import DEFAULT_BUCKET_BYTES, SHARDS, apply_reduce
from .program import WEIGHT_GRAD_BLOCK_BYTES

UPDATES = ("separate", "fused", "blocked")
CONV_ENGINES = Convolution.ENGINES
CONV_CHOICES = ("auto",) + CONV_ENGINES


def _frozen_items(mapping):
    return tuple(sorted(dict(mapping or {}).items()))


@dataclass(frozen=True)
class Options:
    """Everything a compile depends on besides the model file.

    overrides: {layer or stashed tensor name: encoding name}; densities: {tensor name: the
    largest fraction of non-zeros SSDC plans for}; budget: bytes the plan must fit (None: no
    limit); conv: an engine of CONV_CHOICES ("auto" is settled by `resolve_conv`); recompute:
    stashed tensors (buffer.tensor names, e.g. "conv1@relu1") dropped after the forward pass
    and rebuilt before their backward use (passes/recompute.py); recompute_shared: those of
    them whose copy is kept once a replay for another tensor rebuilds it; microbatch: (blob,
    samples), the front of the net through that blob run that many samples at a time
    (passes/microbatch.py), or (); spans: ((start, through, samples), ...), each span of
    layers after blob `start` through blob `through` run that many samples at a time, its
    stashes kept a micro-batch at a time (passes/microbatch.py); ranks, shard, bucket_bytes:
    the program of one of `ranks` data-parallel ranks (passes/reduce.py), `batch_size` then
    being each rank's share of the global batch; chunk_bytes: the batch-chunk target of every
    layer that works in chunks (None: each layer's own; smaller chunks shrink the workspace,
    and change how the sums over a batch round: a choice of the optimizer under lossy modes
    only)."""
    batch_size: int = None
    input_size: int = None
    input_channels: int = None
    device: str = "cpu"
    dtype: object = np.float32
    conv: str = "im2col"
    alloc: str = "static"
    gist: str = "none"
    dpr: str = "fp16"
    binarize: str = "fused"
    overrides: tuple = field(default=())
    update: str = "separate"
    budget: int = None
    densities: tuple = field(default=())
    add_loss: bool = False
    recompute: tuple = field(default=())
    recompute_shared: tuple = field(default=())
    ranks: int = 1
    shard: str = "none"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    chunk_bytes: int = None
    microbatch: tuple = field(default=())
    spans: tuple = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "overrides", _frozen_items(self.overrides))
        object.__setattr__(self, "densities", _frozen_items(self.densities))
        for name in ("recompute", "recompute_shared"):
            value = getattr(self, name) or ()
            # one name is not its characters; a number is no list
            if isinstance(value, str) or not hasattr(value, "__iter__") or \
                    not all(isinstance(tensor, str) for tensor in value):
                raise MinigistError(f"{name}: expected a list of tensor names, got {value!r}")
            object.__setattr__(self, name, tuple(dict.fromkeys(value)))
        microbatch = tuple(self.microbatch or ())
        if microbatch and (len(microbatch) != 2 or not isinstance(microbatch[0], str)
                           or isinstance(microbatch[1], bool) or not isinstance(microbatch[1], (int, np.integer))):
            raise MinigistError(f"--microbatch: expected BLOB:SAMPLES, got {self.microbatch!r}")
        object.__setattr__(self, "microbatch", (microbatch[0], int(microbatch[1])) if microbatch else ())
        spans = []
        for span in self.spans or ():
            span = tuple(span)
            if len(span) != 3 or not all(isinstance(blob, str) for blob in span[:2]) or isinstance(span[2], bool) \
                    or not isinstance(span[2], (int, np.integer)):
                raise MinigistError(f"--microbatch-span: expected START:THROUGH:SAMPLES, got {span!r}")
            spans.append((span[0], span[1], int(span[2])))
        object.__setattr__(self, "spans", tuple(spans))
        if self.alloc not in MODES:
            raise MinigistError(f"--alloc: expected one of {', '.join(MODES)}, got {self.alloc!r}")
        if self.update not in UPDATES:
            raise MinigistError(f"--update: expected one of {', '.join(UPDATES)}, got {self.update!r}")
        if self.conv not in CONV_CHOICES:
            raise MinigistError(f"--conv: expected one of {', '.join(CONV_CHOICES)}, got {self.conv!r}")
        if self.shard not in SHARDS:
            raise MinigistError(f"--shard: expected one of {', '.join(SHARDS)}, got {self.shard!r}")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, (int, np.integer)) or self.ranks < 1:
            raise MinigistError(f"--ranks: expected a positive integer, got {self.ranks!r}")
        self.gist_config()

    def gist_config(self):
        """The GistConfig these options describe (a MinigistError for an unknown mode)."""
        try:
            return GistConfig(self.gist, self.dpr, self.binarize, dict(self.overrides), dict(self.densities))
        except ValueError as exc:
            raise MinigistError(str(exc)) from None

    def replace(self, **changes):
        return replace(self, **changes)


@dataclass
class Compiled:
    """One phase compiled: its graph, its program after every pass, and the program's plan."""
    graph: object
    program: object
    plan: MemoryPlan
    conv: str                 # the convolution engine the plan was made for


# on a GPU, the layers that work in batch chunks take chunks of this many bytes (at least):
# im2col's columns and their cuBLAS GEMM cover whole batches of a small net (vgg_small's widest
# layer: 26 samples of 2.4 MB at 32x32), and BatchNorm's and pooling's passes one launch each
GPU_CHUNK_BYTES = 64 << 20


def build(model, options, phase="TRAIN"):
    """The graph of `phase`, its Convolution layers made for the engine `options.conv` settles
    on (for `options.device`); returns (graph, engine). On a GPU (or the checker of its rules)
    the chunked layers' chunks grow to GPU_CHUNK_BYTES, in the plan like every workspace."""
    xp = get_xp(options.device)
    conv = check_conv_engine(options.conv, xp, options.dtype)
    graph = build_graph(model, phase, options.batch_size, options.input_size, options.dtype,
                        add_loss=options.add_loss, input_channels=options.input_channels, conv=conv)
    set_chunks(graph, options)
    return graph, conv


def set_chunks(graph, options):
    """Every chunked layer of `graph` works in batch chunks of about `options.chunk_bytes`,
    or, where that is None, of its own size (at least GPU_CHUNK_BYTES on a GPU)."""
    gpu = is_gpu(get_xp(options.device))
    for layer in graph.layers:
        if hasattr(layer, "chunk_bytes"):
            if options.chunk_bytes is not None:
                layer.chunk_bytes = int(options.chunk_bytes)
            else:
                own = type(layer).chunk_bytes
                layer.chunk_bytes = max(own, GPU_CHUNK_BYTES) if gpu else own


def microbatch_clones(model, options, graph, conv, phase="TRAIN"):
    """{samples: the graph a micro-batch of that many samples runs in} for the micro-batched
    front and spans of `graph` (of `phase`, built for engine `conv`): the model set up for a
    batch of `samples` (the passes give their layers the whole batch's chunks). An evaluation
    batch that a micro-batch does not divide runs whole: no graph for it."""
    wanted = [("--microbatch", options.microbatch[1])] if options.microbatch else []
    wanted += [("--microbatch-span", span[2]) for span in options.spans]
    clones = {}
    for flag, samples in wanted:
        if samples in clones or (phase != "TRAIN" and (samples >= graph.batch_size or graph.batch_size % samples)):
            continue
        check_samples(samples, graph.batch_size, flag)
        clones[samples] = build_graph(model, phase, samples, options.input_size, options.dtype,
                                      add_loss=options.add_loss, input_channels=options.input_channels, conv=conv)
    return clones


def run_passes(graph, options, phase="TRAIN", calibrating=False, clones=None):
    """The passes in order: the backward program (an inference program for TEST), the
    recomputation of `options.recompute` (training only), the micro-batched front of
    `options.microbatch` and the spans of `options.spans` (run in `clones`, microbatch_clones'
    graphs by samples), and Gist's schedule
    (training only; after both, so that Gist encodes nothing that is recomputed; `calibrating` plans every SSDC candidate at
    full capacity so that a run can measure its density), the in-place pairs, then the
    reduction across `options.ranks` ranks (last: it adds steps around the others' and storage
    pairs of its own)."""
    train = phase == "TRAIN"
    # blocked: fused, a large weight gradient made and applied a block of rows at a time; across
    # ranks the reduction sums whole weight gradients (passes/reduce.py), so no blocks there
    blocked = options.update == "blocked" and options.ranks == 1
    program = build_program(graph, train=train, fused_update=options.update in ("fused", "blocked"),
                            block_bytes=WEIGHT_GRAD_BLOCK_BYTES if blocked else None)
    if train:
        program = apply_recompute(program, options.recompute, options.recompute_shared)
    if (options.microbatch or options.spans) and options.ranks > 1:
        flag = "--microbatch" if options.microbatch else "--microbatch-span"
        raise MinigistError(f"{flag}: not across ranks (the reduction sums whole gradients)")
    clones = clones or {}
    if options.microbatch and options.microbatch[1] in clones:
        program = apply_microbatch(program, options.microbatch[0], options.microbatch[1],
                                   clones[options.microbatch[1]])
    for start, through, samples in options.spans:
        if samples in clones:
            program = apply_span(program, start, through, samples, clones[samples])
    if train:
        program = apply_gist(program, options.gist_config(), calibrating)
    program = mark_inplace(program)
    return apply_reduce(program, options.ranks, options.shard, options.bucket_bytes)


def compile(model, options=Options(), phase="TRAIN", graph=None, calibrating=False):
    """Compiled(graph, program, plan) of `model` in `phase` under `options`; `graph`, when
    given, is that phase's graph already built by `build` (its layers keep their state)."""
    if graph is None:
        graph, conv = build(model, options, phase)
    else:
        conv = resolve_conv(options.conv, get_xp(options.device), options.dtype)
        if options.chunk_bytes is not None:
            set_chunks(graph, options)
    clones = microbatch_clones(model, options, graph, conv, phase)
    program = run_passes(graph, options, phase, calibrating, clones)
    return Compiled(graph, program, MemoryPlan(program, options.alloc), conv)


def resolve_conv(conv, xp=np, dtype=np.float32):
    """The engine `conv` names: "auto" is oneDNN where it can run (the library loads, the CPU,
    float32), im2col otherwise; the others are themselves."""
    if conv != "auto":
        return conv
    usable = onednn.available() and xp is np and np.dtype(dtype) == np.float32
    return "onednn" if usable else "im2col"


def check_conv_engine(conv, xp=np, dtype=np.float32):
    """The --conv engine ("auto" resolved by resolve_conv), checked against the device and the
    dtype (oneDNN's blocked copies replace the im2col columns in the plan)."""
    if conv not in CONV_CHOICES:
        raise MinigistError(f"--conv: expected one of {', '.join(CONV_CHOICES)}, got {conv!r}")
    conv = resolve_conv(conv, xp, dtype)
    if conv == "onednn":
        if not onednn.available():
            raise MinigistError(f"--conv onednn: {onednn.unavailable_reason()}")
        if xp is not np:
            raise MinigistError("--conv onednn runs on the CPU only (--device cpu)")
        if np.dtype(dtype) != np.float32:
            raise MinigistError(f"--conv onednn runs float32 only, not {np.dtype(dtype).name}")
    return conv


def report_extra(config, update, conv, graph):
    """The report's fields that say what the plan was made for."""
    extra = {"gist": {"mode": config.mode, "dpr": config.dpr, "binarize": config.binarize,
                      "lossless": config.exact}, "update": update, "conv": conv}
    if graph.added_loss:
        extra["added_loss"] = graph.added_loss
    return extra


def plan_footprint(model, batch_size=None, input_size=None, alloc="static", dtype=np.float32,
                   gist="none", dpr="fp16", binarize="fused", ssdc_density=None, update="separate",
                   conv="im2col", add_loss=False, input_channels=None, recompute=(), ranks=1, shard="none",
                   bucket_bytes=DEFAULT_BUCKET_BYTES, recompute_shared=()):
    """The footprint report of one training iteration, computed from shapes alone: no array
    is allocated and nothing runs. SSDC is planned only for tensors given in `ssdc_density`
    (measured densities: a plan cannot see data). With `ranks` > 1: one rank's, `batch_size`
    (None: the model file's) being the global batch the ranks share (passes/reduce.py)."""
    options = Options(batch_size=batch_size, input_size=input_size, input_channels=input_channels, dtype=dtype,
                      conv=conv, alloc=alloc, gist=gist, dpr=dpr, binarize=binarize, update=update,
                      densities=ssdc_density, add_loss=add_loss, recompute=recompute,
                      recompute_shared=recompute_shared, ranks=ranks, shard=shard,
                      bucket_bytes=bucket_bytes)
    return plan_report(model, per_rank(model, options))


def split_batch(global_batch, ranks):
    """Each rank's share of `global_batch`; a one-line error when the ranks cannot divide it."""
    if global_batch % ranks:
        raise MinigistError(f"--batch-size: the global batch of {global_batch} cannot be split evenly among "
                            f"{ranks} ranks (give a multiple of {ranks})")
    return global_batch // ranks


def per_rank(model, options):
    """`options` with `batch_size` taken as the global batch (None: the model file's TRAIN
    batch) and replaced by one rank's share of it."""
    if options.ranks == 1:
        return options
    global_batch = options.batch_size
    if global_batch is None:
        global_batch = build_graph(model, "TRAIN", None, options.input_size, options.dtype, add_loss=options.add_loss,
                                   input_channels=options.input_channels).batch_size
    return options.replace(batch_size=split_batch(global_batch, options.ranks))


def plan_report(model, options):
    """plan_footprint's report for `options`: the training plan, with the evaluation part."""
    train = compile(model, options, "TRAIN")
    evaluation = compile(model, options, "TEST")
    report = footprint_report(train.plan, model=str(model), parameters=train.graph.param_count(),
                              extra=report_extra(options.gist_config(), options.update, train.conv, train.graph))
    return with_evaluation(report, train.plan, evaluation.plan, evaluation.graph)


def with_evaluation(report, train_plan, eval_plan, test_graph):
    """The report with the evaluation program's part: the TEST phase runs at its own batch size
    (a Caffe file may give TEST another one than TRAIN) in the arena's per-iteration part, which
    the two programs share, so the arena holds the larger of the two."""
    report["evaluation"] = {"batch_size": test_graph.batch_size, "transient_bytes": eval_plan.transient_bytes}
    report["footprint_with_evaluation_bytes"] = (report["footprint_bytes"]
                                                 + max(0, eval_plan.transient_bytes - train_plan.transient_bytes))
    return report
