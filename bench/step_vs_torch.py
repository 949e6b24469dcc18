"""Time one SGD training step of minigist against PyTorch on the same net, batch and weights.

    python bench/step_vs_torch.py [--models vgg_small,resnet20,inception_small] [--batch-size 32]
                                  [--repeats 11] [--warmup 2] [--block 4] [--settle 0.3]
                                  [--threads 2] [--blas-threads N] [--lr 0.01] [--no-gist]
                                  [--float64-steps 4] [--conv im2col,onednn]

PyTorch (CPU) is needed for this bench only: `pip install torch`; threadpoolctl, if installed,
sets (--blas-threads, by default --threads) the BLAS threads numpy uses; without it they are
left as they are (OPENBLAS_NUM_THREADS sets them). The report names numpy's BLAS, its kernels
and threads (minigist.blas.describe): an OPENBLAS_CORETYPE in the environment can force older
kernels than the CPU runs (Haswell's AVX2 on an AVX-512 CPU halves the GEMM rate).

minigist runs once per convolution engine in --conv (im2col, minigist's own; onednn, oneDNN's
kernels, where the library is installed: both by default), each net in the same alternation
against the same torch steps, each with its own rows. For each model the equivalent torch.nn module is built from minigist's TRAIN graph (layer by
layer, over the same blob names) and given a copy of minigist's initial weights; both sides
train with SGD (momentum 0.9, weight decay 5e-4, the same lr and per-parameter lr_mult /
decay_mult) on the same two batches in turn. After `--warmup` steps each, the two are timed in
alternating blocks (a block: one untimed step, then `--block` timed ones; minigist, torch,
minigist, ...) so that machine noise hits both alike, with a pause of `--settle` seconds before
each block. Both matter for a fair figure: OpenBLAS's worker threads keep spinning for about
0.1 s after a call and torch's OpenMP threads for a while too, so a step that starts at once
shares the two cores with the other side's spinning threads; and a step that follows the other
side's finds the caches full of the other side's data. Alternating single steps with no pause
measured torch's resnet20 step at 0.10-0.13 s instead of 0.05, and single steps with the pause
its vgg_small step at 0.12 s against 0.096 s run alone (bench/README, session 5). The report
gives, per model:

- the median, min and max step time of each side and the ratio minigist / torch (of the
  medians with the range of the per-pair ratios, and of the minima: the least disturbed
  figure on a shared machine), with the share of the CPU time that other processes took
  meanwhile ('others', from /proc/stat);
- the FLOPs of one step, counted from the graph (convolution and inner-product layers only:
  2 * MACs forward, twice that backward), and each side's share of the float32 GEMM rate of
  this machine, measured with numpy (1024 x 1024 matmul) in the same run;
- the loss of the first step (initial weights, batch 0) on both sides and their relative
  difference, which must be below 1e-4; the largest difference over all later steps and the
  relative L2 distance of the trained weights after them, which check the update rule too;
  and the same two figures for a few untimed steps run in float64 on both sides, where
  rounding no longer hides a semantic mismatch (they agree to about 1e-15);
- unless --no-gist, each Gist mode's minigist step time (none, lossless, lossy fp16,
  all fp16; calibrated on the two batches, timed in alternation) as a ratio to none; with
  numba installed the codecs run their compiled kernels, and `all fp16` is timed once more with
  the codecs on their ufunc path (kernels.use_codec_kernels(False); MAX pooling's kernels stay
  on, as in every other column) in the same alternation.

Semantics mapped (Caffe -> torch): Convolution -> conv2d (pad, stride, dilation, group,
bias_term); Pooling MAX/AVE -> max_pool2d / avg_pool2d(count_include_pad=True) with
ceil_mode for Caffe's CEIL rounding (output sizes are checked against minigist's: they differ
only in the 'empty window' case, pad 0 and stride > kernel, which is refused); BatchNorm in
TRAIN (batch statistics, the layer's eps) followed by a per-channel Scale -> one
batch_norm with the Scale's scale and bias as weight and bias (as a torch user would write
it); Eltwise SUM (coeff) / PROD / MAX; Concat -> cat; InnerProduct -> flatten + linear;
SoftmaxWithLoss -> cross_entropy with Caffe's normalization; Dropout -> dropout (random masks
differ, so a net with dropout gets no loss check). Caffe's SGD (v = m v + lr (g + wd w);
w -= v) and torch.optim.SGD (v = m v + (g + wd w); w -= lr v) differ only in where lr sits:
with a constant lr they give the same weights (Caffe's v is lr times torch's).
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import isa  # noqa: E402
import load  # noqa: E402
import minigist  # noqa: E402
from minigist import blas, onednn  # noqa: E402
from minigist.codecs import kernels  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:   # the bench needs it; the package and its tests do not
    sys.exit("bench/step_vs_torch.py needs PyTorch: pip install torch")

try:
    import threadpoolctl
except ImportError:
    threadpoolctl = None

GIST_CONFIGS = [("none", "none", "fp16"), ("lossless", "lossless", "fp16"),
                ("lossy fp16", "lossy", "fp16"), ("all fp16", "all", "fp16")]
# with numba installed the codecs run compiled kernels; this extra column times `all fp16` on
# the ufunc path in the same run, for comparison
UFUNC_CONFIG = ("all fp16, ufunc codecs", "all", "fp16")
LOSS_RTOL = 1e-4        # float32, first step
EXACT_RTOL = 1e-9       # float64, every checked step


# ---- the torch twin of a minigist graph -------------------------------------------------------
def _torch_pool_size(size, k, s, p, ceil):
    """PyTorch's pooling output size (aten pooling_output_shape, dilation 1)."""
    out = (size + 2 * p - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


class TorchTwin(torch.nn.Module):
    """A torch.nn.Module that runs minigist's TRAIN graph node by node over the same blob ids,
    with a copy of `values` ({"layer.param": numpy array}, minigist's params()) as weights."""

    def __init__(self, graph, values):
        super().__init__()
        self.graph = graph
        self.tensors = {}          # "layer.param" -> Parameter (trained) or buffer
        self.multipliers = {}      # "layer.param" -> (lr_mult, decay_mult), trained ones
        self.ops = []              # callables(blobs) in graph order
        self.inputs = []           # data tops fed in order: data, label
        self.has_dropout = False
        self.fused = []            # (BatchNorm, Scale) layer names run as one batch_norm
        self.batch_norms = []     # every BatchNorm layer name, in order
        for layer in {node.layer.name: node.layer for node in graph.nodes}.values():
            for decl in layer.params:
                key = f"{layer.name}.{decl.name}"
                value = torch.from_numpy(np.array(values[key], copy=True))
                safe = "p%d_%s" % (len(self.tensors), "".join(c if c.isalnum() else "_" for c in key))
                if decl.trained:
                    tensor = torch.nn.Parameter(value)
                    self.register_parameter(safe, tensor)
                    self.multipliers[key] = (decl.lr_mult, decl.decay_mult)
                else:
                    self.register_buffer(safe, value)
                    tensor = getattr(self, safe)
                self.tensors[key] = tensor
        skip = set()
        for index, node in enumerate(graph.nodes):
            if index in skip:
                continue
            op = self._op(index, node, skip)
            if op is not None:
                self.ops.append(op)
        self.loss_weights = dict(graph.loss_weights)

    def param(self, layer, name):
        return self.tensors[f"{layer.name}.{name}"]

    def _fusable_scale(self, node):
        """The index of the Scale node right after a BatchNorm, if it only rescales per channel
        the BatchNorm's output and nothing else reads that output."""
        consumers = self.graph.blobs[node.tops[0]].consumers
        if len(consumers) != 1:
            return None
        index, _ = consumers[0]
        scale = self.graph.nodes[index].layer
        ndim = len(node.layer.top_shapes[0])
        channels = node.layer.top_shapes[0][1] if ndim > 1 else 1
        if scale.type != "Scale" or len(self.graph.nodes[index].bottoms) != 1 or ndim < 2:
            return None
        if tuple(scale.bcast) != (1, channels) + (1,) * (ndim - 2):
            return None
        return index

    def _op(self, index, node, skip):
        layer, bottoms, tops = node.layer, node.bottoms, node.tops
        kind = layer.type
        if layer.is_data:
            self.inputs.extend(tops)
            return None
        if kind == "Convolution":
            weight = self.param(layer, "weight")
            bias = self.param(layer, "bias") if layer.bias_term else None
            stride, pad, dilation, group = layer.stride, layer.pad, layer.dilation, layer.group

            def conv(blobs):
                blobs[tops[0]] = F.conv2d(blobs[bottoms[0]], weight, bias, stride, pad, dilation, group)
            return conv
        if kind == "ReLU":
            slope = layer.slope

            def relu(blobs):
                x = blobs[bottoms[0]]
                blobs[tops[0]] = F.relu(x) if slope == 0.0 else F.leaky_relu(x, slope)
            return relu
        if kind == "Pooling":
            n, c, h, w = layer.in_shape
            kernel, stride, pad = layer.kernel, layer.stride, layer.pad
            ceil = layer.round_mode == "CEIL"
            got = tuple(_torch_pool_size(size, k, s, p, ceil)
                        for size, k, s, p in zip((h, w), kernel, stride, pad))
            if got != tuple(layer.out_hw) or any(p > k // 2 for p, k in zip(pad, kernel)):
                raise NotImplementedError(
                    f"{layer.name}: Caffe's pooling gives {layer.out_hw}, torch would give {got} "
                    f"(kernel {kernel}, stride {stride}, pad {pad}): no torch equivalent")
            if layer.method == "MAX":
                def pool(blobs):
                    blobs[tops[0]] = F.max_pool2d(blobs[bottoms[0]], kernel, stride, pad, ceil_mode=ceil)
            else:   # Caffe's divisor counts padding, not the ceil overhang: as torch's
                def pool(blobs):
                    blobs[tops[0]] = F.avg_pool2d(blobs[bottoms[0]], kernel, stride, pad, ceil_mode=ceil,
                                                  count_include_pad=True)
            return pool
        if kind == "BatchNorm":
            return self._batch_norm(index, node, skip)
        if kind == "Scale":
            scale = self.param(layer, "scale")
            bias = self.param(layer, "bias") if layer.bias_term else None
            shape = tuple(layer.bcast)

            def scale_op(blobs):
                y = blobs[bottoms[0]] * scale.reshape(shape)
                blobs[tops[0]] = y if bias is None else y + bias.reshape(shape)
            return scale_op
        if kind == "Eltwise":
            operation, coeff = layer.operation, [float(a) for a in layer.coeff]

            def eltwise(blobs):
                xs = [blobs[b] for b in bottoms]
                if operation == "SUM":
                    y = xs[0] if coeff[0] == 1.0 else xs[0] * coeff[0]
                    for a, x in zip(coeff[1:], xs[1:]):
                        y = y + x if a == 1.0 else y + a * x
                elif operation == "PROD":
                    y = xs[0]
                    for x in xs[1:]:
                        y = y * x
                else:   # MAX (ties: Caffe sends the gradient to the first, torch splits it)
                    y = xs[0]
                    for x in xs[1:]:
                        y = torch.maximum(y, x)
                blobs[tops[0]] = y
            return eltwise
        if kind == "Concat":
            axis = layer.axis

            def concat(blobs):
                blobs[tops[0]] = torch.cat([blobs[b] for b in bottoms], dim=axis)
            return concat
        if kind == "InnerProduct":
            weight = self.param(layer, "weight")
            bias = self.param(layer, "bias") if layer.bias_term else None
            rows, transpose = layer.rows, layer.transpose
            top_shape = layer.top_shapes[0]

            def inner_product(blobs):
                x = blobs[bottoms[0]].reshape(rows, -1)
                y = F.linear(x, weight.t() if transpose else weight, bias)
                blobs[tops[0]] = y.reshape(top_shape)
            return inner_product
        if kind == "SoftmaxWithLoss":
            return self._softmax_loss(layer, bottoms, tops)
        if kind == "Softmax":
            axis = layer.axis

            def softmax(blobs):
                blobs[tops[0]] = F.softmax(blobs[bottoms[0]], dim=axis)
            return softmax
        if kind == "Dropout":
            self.has_dropout = self.has_dropout or layer.ratio > 0
            ratio, post = layer.ratio, layer.scale * (1.0 - layer.ratio)

            def dropout(blobs):
                y = F.dropout(blobs[bottoms[0]], p=ratio, training=True)
                blobs[tops[0]] = y if post == 1.0 else y * post
            return dropout
        if kind == "LRN":
            size, alpha, beta, k = layer.size, layer.alpha, layer.beta, layer.k

            def lrn(blobs):
                blobs[tops[0]] = F.local_response_norm(blobs[bottoms[0]], size, alpha, beta, k)
            return lrn
        if kind in ("Flatten", "Reshape"):
            shape = layer.top_shapes[0]

            def reshape(blobs):
                blobs[tops[0]] = blobs[bottoms[0]].reshape(shape)
            return reshape
        if kind == "Split":
            def split(blobs):
                for top in tops:
                    blobs[top] = blobs[bottoms[0]]
            return split
        if kind in ("Silence", "Accuracy"):
            return None
        raise NotImplementedError(f"layer '{layer.name}': type {kind} has no torch mapping in this bench")

    def _batch_norm(self, index, node, skip):
        """Caffe's BatchNorm (+ the Scale after it, fused as torch's affine batch norm)."""
        layer, bottom = node.layer, node.bottoms[0]
        scale_index = self._fusable_scale(node)
        weight = bias = None
        top = node.tops[0]
        if scale_index is not None:
            skip.add(scale_index)
            scale_node = self.graph.nodes[scale_index]
            weight = self.param(scale_node.layer, "scale")
            bias = self.param(scale_node.layer, "bias") if scale_node.layer.bias_term else None
            top = scale_node.tops[0]
            self.fused.append((layer.name, scale_node.layer.name))
        eps, training = layer.eps, not layer.use_global
        channels = layer.shape3[1]
        sums = (self.param(layer, "mean"), self.param(layer, "variance"), self.param(layer, "scale_factor"))
        if training:   # torch keeps its own running averages (the step's output ignores them)
            running_mean = torch.zeros(channels, dtype=sums[0].dtype)
            running_var = torch.ones(channels, dtype=sums[0].dtype)
        else:          # Caffe's running sums divided by the scale factor (0 -> 0)
            factor = float(sums[2][0])
            factor = 0.0 if factor == 0 else 1.0 / factor
            running_mean, running_var = sums[0] * factor, sums[1] * factor
        # buffers, so that .double() and the like convert them with the weights
        stats = "bn%d" % len(self.batch_norms)
        self.batch_norms.append(layer.name)
        self.register_buffer(stats + "_mean", running_mean.clone())
        self.register_buffer(stats + "_var", running_var.clone())
        momentum = 1.0 - layer.maf
        shape3 = layer.shape3

        def batch_norm(blobs):
            x = blobs[bottom]
            y = F.batch_norm(x.reshape(shape3), getattr(self, stats + "_mean"), getattr(self, stats + "_var"),
                             weight, bias, training=training, momentum=momentum, eps=eps)
            blobs[top] = y.reshape(x.shape)
        return batch_norm

    def _softmax_loss(self, layer, bottoms, tops):
        outer, classes, inner = layer.outer, layer.classes, layer.inner
        ignore, normalization = layer.ignore_label, layer.normalization

        def softmax_loss(blobs):
            scores = blobs[bottoms[0]].reshape(outer, classes, inner)
            labels = blobs[bottoms[1]].reshape(outer, inner)
            total = F.cross_entropy(scores, labels, reduction="sum",
                                    ignore_index=-100 if ignore is None else int(ignore))
            if normalization == "FULL" or (normalization == "VALID" and ignore is None):
                count = outer * inner
            elif normalization == "VALID":
                count = int((labels != int(ignore)).sum())
            elif normalization == "BATCH_SIZE":
                count = outer
            else:
                count = 1
            blobs[tops[0]] = total / max(1.0, float(count))
            if len(tops) == 2:
                blobs[tops[1]] = F.softmax(blobs[bottoms[0]], dim=layer.axis)
        return softmax_loss

    def forward(self, *inputs):
        blobs = dict(zip(self.inputs, inputs))
        for op in self.ops:
            op(blobs)
        return sum(weight * blobs[blob] for blob, weight in self.loss_weights.items())

    def optimizer(self, lr, momentum, weight_decay):
        """torch.optim.SGD with one group per (lr_mult, decay_mult), as Caffe's solver."""
        groups = {}
        for key, mults in self.multipliers.items():
            groups.setdefault(mults, []).append(self.tensors[key])
        return torch.optim.SGD([{"params": params, "lr": lr * lr_mult, "weight_decay": weight_decay * decay_mult}
                                for (lr_mult, decay_mult), params in groups.items()],
                               lr=lr, momentum=momentum, weight_decay=weight_decay)


# ---- measurements ----------------------------------------------------------------------------
def step_flops(graph):
    """FLOPs of one training step from the graph: 2 * MACs forward for convolution and inner
    product layers, twice that backward (input and weight gradients), so 6 * MACs in all."""
    macs = 0
    for node in graph.nodes:
        layer = node.layer
        if layer.type == "Convolution":
            n, c = layer.in_shape[:2]
            oh, ow = layer.out_hw
            kh, kw = layer.kernel
            macs += n * layer.num_output * oh * ow * (c // layer.group) * kh * kw
        elif layer.type == "InnerProduct":
            macs += layer.rows * layer.features * layer.num_output
    return 6 * macs


def _timed_rates(multiply, reps, n):
    """GFLOP/s of `multiply()` (an n x n x n product), after 3 warm-ups, one per repetition."""
    for _ in range(3):
        multiply()
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        multiply()
        rates.append(2 * n ** 3 / (time.perf_counter() - start) / 1e9)
    return rates


def gemm_rates(reps=15, n=1024):
    """GFLOP/s of numpy's float32 n x n matmul, one figure per repetition."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    return _timed_rates(lambda: np.matmul(a, b, out=c), reps, n)


def torch_gemm_rates(reps=15, n=1024):
    """The same for torch.mm, for reference."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    return _timed_rates(lambda: torch.mm(a, b, out=c), reps, n)


def spread(times):
    return statistics.median(times), min(times), max(times)


def fmt_time(times):
    med, lo, hi = spread(times)
    return f"{med:.3f} [{lo:.3f}-{hi:.3f}]"


def make_batches(rng, batch_size, input_shape, classes=10, count=2):
    return [(rng.standard_normal((batch_size,) + tuple(input_shape)).astype(np.float32),
             rng.integers(0, classes, batch_size)) for _ in range(count)]


def torch_step(model, optimizer, images, labels):
    optimizer.zero_grad(set_to_none=True)
    loss = model(images, labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def compare(args, name, path):
    """Alternate the minigist nets (one per --conv engine) and torch's steps on one model;
    returns one result dict per engine, and the batches."""
    nets = {}
    for engine in args.conv:
        solver = minigist.SGD(lr=args.lr, momentum=0.9, weight_decay=5e-4)
        nets[engine] = minigist.Net(path, batch_size=args.batch_size, seed=0, solver=solver, alloc="static",
                                    conv=engine, threads=bench_threads(args, engine))
    net = nets[args.conv[0]]
    graph = net.train_graph
    rng = np.random.default_rng(0)
    batches = make_batches(rng, args.batch_size, graph.input_shape)
    model = TorchTwin(graph, {k: np.asarray(v) for k, v in net.params().items()})
    optimizer = model.optimizer(args.lr, 0.9, 5e-4)
    torch_batches = [(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))) for x, y in batches]
    sides = {engine: (lambda step, n=n: n.train_step(*batches[step % 2])) for engine, n in nets.items()}
    sides["torch"] = lambda step: torch_step(model, optimizer, *torch_batches[step % 2])
    losses = {label: [] for label in sides}
    times = {label: [] for label in sides}
    for step in range(args.warmup):
        for label, run in sides.items():
            losses[label].append(run(step))
    meter = load.sample()
    while len(times["torch"]) < args.repeats:
        for label, run in sides.items():
            time.sleep(args.settle)
            # a block's first step runs in the caches and thread states the other side
            # left: untimed, its loss still checked
            for index in range(args.block + 1):
                step = len(losses[label])
                start = time.perf_counter()
                losses[label].append(run(step))
                elapsed = time.perf_counter() - start
                if index and len(times[label]) < args.repeats:
                    times[label].append(elapsed)
    others = load.others_share(meter, load.sample())
    flops = step_flops(graph)
    results = []
    for engine, net in nets.items():
        rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[engine], losses["torch"])]
        # the trained weights after the same steps on both sides, as one relative L2 distance
        # (a float32 near-tie in a max pool can route one gradient element elsewhere, so
        # element-wise maxima are noisy; the norm is not)
        results.append({
            "name": name, "engine": engine, "rel": rel, "flops": flops,
            "times": {"minigist": times[engine], "torch": times["torch"]},
            "losses": {"minigist": losses[engine], "torch": losses["torch"]},
            "weight_diff": weight_distance(net, model), "others": others, "dropout": model.has_dropout,
            "fused": len(model.fused), "pair_ratios": [a / b for a, b in zip(times[engine], times["torch"])]})
    return results, batches


def float64_check(args, path, batches):
    """Train both sides in float64 from the same weights for --float64-steps steps: with
    rounding out of the way they must agree to ~1e-15, which checks every mapped semantic
    (and the update rule) far more tightly than the float32 run can. Returns (largest loss
    difference, relative L2 distance of the trained weights), both relative."""
    solver = minigist.SGD(lr=args.lr, momentum=0.9, weight_decay=5e-4)
    net = minigist.Net(path, batch_size=args.batch_size, seed=0, solver=solver, dtype=np.float64)
    model = TorchTwin(net.train_graph, {k: np.asarray(v) for k, v in net.params().items()})
    optimizer = model.optimizer(args.lr, 0.9, 5e-4)
    worst = 0.0
    for step in range(args.float64_steps):
        images, labels = batches[step % 2]
        ours = net.train_step(images.astype(np.float64), labels)
        theirs = torch_step(model, optimizer, torch.from_numpy(images.astype(np.float64)),
                            torch.from_numpy(labels.astype(np.int64)))
        worst = max(worst, abs(ours - theirs) / max(abs(theirs), 1e-300))
    return worst, weight_distance(net, model)


def weight_distance(net, model):
    """||w_minigist - w_torch|| / ||w_torch|| over all trained weights."""
    diff = norm = 0.0
    for key, value in net.params().items():
        if key in model.multipliers:
            theirs = model.tensors[key].detach().numpy().astype(np.float64)
            diff += float(np.sum((np.asarray(value, np.float64) - theirs) ** 2))
            norm += float(np.sum(theirs ** 2))
    return (diff / max(norm, 1e-300)) ** 0.5


def gist_configs():
    return GIST_CONFIGS + ([UFUNC_CONFIG] if kernels.available() else [])


def gist_ratios(args, path, batches, engine):
    """Each Gist mode's median step time with one --conv engine; the nets calibrated on
    `batches`, then alternated."""
    nets, kernel_flags = {}, {}
    for label, gist, dpr in gist_configs():
        kernel_flags[label] = kernels.available() and label != UFUNC_CONFIG[0]
        solver = minigist.SGD(lr=args.lr, momentum=0.9, weight_decay=5e-4)
        net = minigist.Net(path, batch_size=args.batch_size, seed=0, solver=solver, gist=gist, dpr=dpr,
                           conv=engine, threads=bench_threads(args, engine))
        net.calibrate(batches)
        for step in range(args.warmup):
            net.train_step(*batches[step % 2])
        nets[label] = net
    times = {label: [] for label in nets}
    meter = load.sample()
    for repeat in range(args.repeats):
        for label, net in nets.items():
            with kernels.use_codec_kernels(kernel_flags[label]):
                start = time.perf_counter()
                net.train_step(*batches[repeat % 2])
                times[label].append(time.perf_counter() - start)
    fallbacks = {label: net.stats.fallbacks for label, net in nets.items()}
    return times, fallbacks, load.others_share(meter, load.sample())


def bench_threads(args, engine):
    """The threads a benchmarked Net runs its steps on: --blas-threads for im2col (its BLAS),
    oneDNN's OpenMP threads for onednn, as these benches ran before Net applied its own default
    thread policy (minigist.default_threads)."""
    return args.blas_threads if engine == "im2col" else onednn.max_threads()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg_small,resnet20,inception_small",
                        help="comma-separated names of models/*.prototxt")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per side (per Gist mode)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side before timing")
    parser.add_argument("--block", type=int, default=4,
                        help="timed steps per side in a row, after one untimed step (default 4)")
    parser.add_argument("--settle", type=float, default=0.3,
                        help="seconds of pause before each block, so that the other side's "
                             "spinning BLAS/OpenMP threads are asleep when it starts")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (torch.set_num_threads)")
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="numpy's BLAS threads, set through threadpoolctl (default: --threads)")
    parser.add_argument("--conv", default=None,
                        help="comma-separated minigist convolution engines to time (im2col, onednn; "
                             "default: both where oneDNN is installed, else im2col)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--no-gist", action="store_true", help="skip the Gist-mode timings")
    parser.add_argument("--float64-steps", type=int, default=4,
                        help="untimed float64 steps on both sides to check the semantics (0: skip)")
    isa.add_argument(parser)
    args = parser.parse_args()
    isa.rerun_if_emulating(args.isa)
    if args.blas_threads is None:
        args.blas_threads = args.threads
    if args.conv is None:
        args.conv = "im2col,onednn" if onednn.available() else "im2col"
    args.conv = [engine for engine in args.conv.split(",") if engine]
    for engine in args.conv:
        if engine not in minigist.CONV_ENGINES:
            parser.error(f"--conv: unknown engine {engine!r} (expected {', '.join(minigist.CONV_ENGINES)})")
        if engine == "onednn" and not onednn.available():
            parser.error(f"--conv onednn: {onednn.unavailable_reason()}")
    if not args.conv:
        parser.error("--conv: name at least one engine")
    counts = (args.repeats, args.threads, args.blas_threads, args.batch_size, args.block)
    if min(counts) < 1 or min(args.warmup, args.float64_steps, args.settle) < 0:
        parser.error("--repeats, --block, --threads, --blas-threads and --batch-size must be at least 1, "
                     "--warmup, --settle and --float64-steps at least 0")
    torch.set_num_threads(args.threads)
    limiter = None
    if threadpoolctl is not None:
        limiter = threadpoolctl.threadpool_limits(limits=args.blas_threads, user_api="blas")
    models = [m for m in args.models.split(",") if m]
    paths = {}
    for name in models:
        paths[name] = name if name.endswith(".prototxt") else os.path.join(ROOT, "models", name + ".prototxt")
        if not os.path.exists(paths[name]):
            parser.error(f"--models: no model file {paths[name]}")

    gemm, tgemm, load_average = gemm_rates(), torch_gemm_rates(), os.getloadavg()[0]
    print("command: python bench/step_vs_torch.py " + " ".join(sys.argv[1:]))
    print(f"machine: {os.cpu_count()} CPUs; numpy {np.__version__}, BLAS: {blas.describe()}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; instruction set: {isa.describe()}")
    print(f"minigist convolution engines: {', '.join(args.conv)}"
          + (f"; {onednn.describe()}, OpenMP threads: {onednn.max_threads()}, "
             "numpy's BLAS on 1 thread during its steps" if "onednn" in args.conv else ""))
    print(f"batch {args.batch_size}, float32, SGD lr {args.lr} momentum 0.9 weight decay 5e-4; "
          f"{args.warmup} warm-up + {args.repeats} timed steps per side, in alternating blocks of 1 untimed + "
          f"{args.block} timed after a {args.settle:g} s pause; times in s/step as median [min-max]")
    print(flush=True)
    results, gist = [], {}
    for name in models:
        print(f"[{name}] minigist vs torch ...", file=sys.stderr, flush=True)
        rows, batches = compare(args, name, paths[name])
        if args.float64_steps:
            check = float64_check(args, paths[name], batches)
            for row in rows:
                row["float64"] = check
        results.extend(rows)
        if not args.no_gist:
            for engine in args.conv:
                print(f"[{name}] Gist modes, {engine} ...", file=sys.stderr, flush=True)
                gist[name, engine] = gist_ratios(args, paths[name], batches, engine)
    gemm += gemm_rates()      # once more at the end: the figure covers the whole run
    tgemm += torch_gemm_rates()
    rate = statistics.median(gemm)

    print(f"numpy float32 GEMM (1024^3 matmul): {rate:.1f} GFLOP/s median "
          f"[{min(gemm):.1f}-{max(gemm):.1f}] over {len(gemm)} runs, start and end; "
          f"torch.mm for reference: {statistics.median(tgemm):.1f} [{min(tgemm):.1f}-{max(tgemm):.1f}]")
    print(f"1-minute load average before the run: {load_average:.2f} (on {os.cpu_count()} CPUs); 'others': the share "
          f"of the machine's CPU time that other processes (and steal) took while the rows were timed")
    print()
    print("| model | conv | minigist s/step | torch s/step | minigist/torch: medians (pairs min-max) | minima "
          "| GFLOP/step | GEMM share minigist | GEMM share torch | others |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        t = r["times"]
        ratio = statistics.median(t["minigist"]) / statistics.median(t["torch"])
        best = min(t["minigist"]) / min(t["torch"])
        shares = [f"{100 * r['flops'] / statistics.median(ts) / 1e9 / rate:.1f}% "
                  f"({100 * r['flops'] / min(ts) / 1e9 / max(gemm):.1f}%)" for ts in (t["minigist"], t["torch"])]
        print(f"| {r['name']} | {r['engine']} | {fmt_time(t['minigist'])} | {fmt_time(t['torch'])} | {ratio:.2f} "
              f"({min(r['pair_ratios']):.2f}-{max(r['pair_ratios']):.2f}) | {best:.2f} | {r['flops'] / 1e9:.2f} "
              f"| {shares[0]} | {shares[1]} | {r['others']} |")
    print("GEMM share: step FLOPs / median step time / median GEMM rate "
          "(in parentheses: / fastest step / fastest GEMM, the least disturbed figures)")
    print()
    f64 = f"float64, {args.float64_steps} steps: loss / weights rel. diff"
    print(f"| model | conv | first-step loss minigist | torch | rel. diff | check (< {LOSS_RTOL:g}; "
          f"float64 < {EXACT_RTOL:g}) | max rel. diff, all steps | weights after all steps, rel. L2 diff | {f64} |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    failed = False
    for r in results:
        first = r["rel"][0]
        exact = "skipped" if "float64" not in r else f"{r['float64'][0]:.1e} / {r['float64'][1]:.1e}"
        if r["dropout"]:
            verdict = "n/a (dropout)"
        else:
            bad = first >= LOSS_RTOL or ("float64" in r and r["float64"][0] >= EXACT_RTOL)
            verdict = "FAIL" if bad else "ok"
            failed = failed or bad
        print(f"| {r['name']} | {r['engine']} | {r['losses']['minigist'][0]:.7f} | {r['losses']['torch'][0]:.7f} | {first:.1e} "
              f"| {verdict} | {max(r['rel']):.1e} | {r['weight_diff']:.1e} | {exact} |")
    print("torch twins: " + ", ".join(f"{r['name']} {r['fused']} BatchNorm+Scale pairs run as one batch_norm"
                                      for r in results if r["engine"] == args.conv[0]))
    print("float64: the im2col engine (oneDNN's CPU kernels have no float64)")
    if gist:
        print()
        print(f"codecs: {kernels.describe()}")
        print("| model | conv | " + " | ".join(f"{label} s/step (ratio)" for label, _, _ in gist_configs())
              + " | SSDC fallbacks | others |")
        print("|---|---|" + "---:|" * len(gist_configs()) + "---:|---:|")
        for (name, engine), (times, fallbacks, others) in gist.items():
            base = statistics.median(times["none"])
            cells = [f"{fmt_time(t)} ({statistics.median(t) / base:.3f})" for t in times.values()]
            print(f"| {name} | {engine} | " + " | ".join(cells) + f" | {sum(fallbacks.values())} | {others} |")
    if limiter is not None:
        limiter.restore_original_limits()
    if failed:
        print(f"\nFAIL: a first-step loss differs by more than {LOSS_RTOL:g}, or a float64 loss by more than "
              f"{EXACT_RTOL:g} (relative)")
        sys.exit(1)


if __name__ == "__main__":
    main()
