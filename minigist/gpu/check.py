"""The checks of the GPU path, as functions of an array module: the GPU tests
(tests/test_gpu_kernels.py) and tools/gpu_check.py call them with cupy; the dry run calls them
with the checker's stand-in (minigist/gpu/rules.py), which exercises their structure only (its
"kernels" are the numpy code). Each returns JSON-ready data.
"""
import os
import statistics
import time

import numpy as np

from .. import jit
from ..backend import to_numpy
from ..codecs.bits import BitMask, PackedCodes
from ..codecs.dpr import DPR, FORMATS
from ..codecs.fused import FusedReluPool
from ..codecs.ssdc import SSDC
from ..graph import MODELS_DIR
from . import kernels as gpu_kernels

RNG_SEED = 11


def _buffers(xp, decls, fill=0):
    return {name: xp.full(d.shape, fill, dtype=d.dtype) for name, d in decls.items()}


def _host(arrays):
    return {name: np.array(to_numpy(a)) for name, a in arrays.items()}


def _ssdc_used(codec, data, n):
    """The bytes of an SSDC encoding that its format uses (header, values, format part)."""
    fmt, nnz = int(data[0]), int(data[1])
    cap, rows, vw, _ = codec._layout(n)
    values = data[2:2 + vw].view(np.uint8)
    value_bytes = gpu_kernels._value_bytes(codec)
    used_values = values[:nnz * value_bytes] if value_bytes else data[2:2 + -(-nnz // 3)].view(np.uint8)
    tail = data[2 + vw:].view(np.uint8)
    part = tail[:4 * (rows + 1) + nnz] if fmt == 1 else tail[:-(-n // 8)] if fmt == 2 else tail[:0]
    return np.concatenate([data[:2].view(np.uint8), used_values, part])


def _codecs():
    rng = np.random.default_rng(RNG_SEED)
    shape = (4, 16, 24, 24)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:64] = np.array([0, -0.0, 1e-40, -1e-40, 6e-8, 3e-5, 65504, 70000, np.inf, -np.inf, np.nan] * 5
                                  + [1e-45] * 9, np.float32)
    sparse = np.maximum(x, 0)
    sparse[rng.random(shape) < 0.8] = 0
    nnz = int(np.count_nonzero(sparse))
    cases = [(f"dpr-{fmt}", DPR(fmt), x) for fmt in FORMATS]
    cases += [("mask-1bit", BitMask(), x), ("mask-1bit bool", BitMask(), x > 0)]
    cases += [(f"index-{bits}bit", PackedCodes(bits), rng.integers(0, 1 << bits, shape).astype(np.uint8))
              for bits in (1, 2, 4)]
    for value_format in ("fp32", "fp16", "fp10", "fp8-e4m3", "fp8-e5m2"):
        cases.append((f"ssdc-{value_format} csr", SSDC(nnz + 10, value_format), sparse))
        cases.append((f"ssdc-{value_format} bitmap", SSDC(nnz + 10, value_format, formats=("bitmap",)), sparse))
    cases.append(("ssdc over capacity", SSDC(nnz // 2), sparse))
    # more 256-element rows than the chunk's workspace has elements (ResNet-50's 56x56 stashes
    # at batch 64 against the default chunk): the bitmap row offsets still need their room
    wide = np.maximum(rng.standard_normal((4, 16, 48, 48)).astype(np.float32), 0)
    cases.append(("ssdc bitmap, rows beyond the chunk",
                  SSDC(int(np.count_nonzero(wide)), formats=("bitmap",), chunk=256), wide))
    pooled = rng.standard_normal((4, 16, 12, 12)).astype(np.float32)
    cases.append(("relu-pool-4bit", FusedReluPool(PackedCodes(4), 9),
                  (rng.integers(0, 9, pooled.shape).astype(np.uint8), pooled)))
    return cases


def codec_bytes(xp):
    """Every codec's encode and decode through `xp` (its GPU kernels) against numpy's path:
    the same used bytes and the same decoded values, one row per codec."""
    rows = []
    for name, codec, x in _codecs():
        shape = x[1].shape if isinstance(x, tuple) else x.shape
        enc_np = _buffers(np, codec.encoded(shape))
        enc_xp = _buffers(xp, codec.encoded(shape))
        ws_np = {p: _buffers(np, codec.workspace(shape, p)) for p in ("encode", "decode")}
        ws_xp = {p: _buffers(xp, codec.workspace(shape, p)) for p in ("encode", "decode")}
        x_xp = tuple(xp.asarray(a) for a in x) if isinstance(x, tuple) else xp.asarray(x)
        over = isinstance(codec, SSDC) and int(np.count_nonzero(x)) > codec.capacity
        with jit.use_kernels(False):
            if isinstance(codec, SSDC):
                stats_np, stats_xp = np.zeros(2, np.int32), xp.zeros(2, dtype=np.int32)
                from ..codecs.ssdc import _encode_reference
                _encode_reference(np, codec, x.reshape(-1).view(np.uint32), enc_np, ws_np["encode"], stats_np, 0)
                codec.encode_device(xp, x_xp, enc_xp, ws_xp["encode"], stats_xp, 0)
            else:
                codec.encode(np, x, enc_np, ws_np["encode"])
                codec.encode(xp, x_xp, enc_xp, ws_xp["encode"])
            host = _host(enc_xp)
            if isinstance(codec, SSDC):
                same_enc = np.array_equal(_ssdc_used(codec, host["data"], int(np.prod(shape))),
                                          _ssdc_used(codec, enc_np["data"], int(np.prod(shape))))
                same_enc = same_enc and np.array_equal(np.array(to_numpy(stats_xp)), stats_np)
            else:
                same_enc = all(np.array_equal(host[k], enc_np[k]) for k in enc_np)
            out_np = np.empty(shape, codec.decoded_dtype(np.dtype(np.float32)))
            out_xp = xp.empty(shape, dtype=out_np.dtype)
            if isinstance(codec, SSDC):
                from ..codecs.ssdc import _decode_reference
                _decode_reference(np, codec, enc_np, out_np, ws_np["decode"])
            else:
                codec.decode(np, enc_np, out_np, ws_np["decode"])
            codec.decode(xp, enc_xp, out_xp, ws_xp["decode"])
        same_dec = np.array_equal(np.array(to_numpy(out_xp)).view(np.uint8), out_np.view(np.uint8))
        rows.append({"codec": name, "shape": list(shape), "encode_same": bool(same_enc),
                     "decode_same": bool(same_dec), "over_capacity": over, "same": bool(same_enc and same_dec)})
    return rows


def layer_kernels(xp):
    """The layer kernels against their numpy code on the same inputs (bytes)."""
    from ..layers import normalization
    from ..testing import make_layer
    rng = np.random.default_rng(RNG_SEED)
    rows = []

    def compare(name, run_np, run_xp, arrays):
        host = [np.array(a) for a in arrays]
        device = [xp.asarray(a) for a in arrays]
        run_np(host)
        run_xp(device)
        same = all(np.array_equal(np.array(to_numpy(d)).view(np.uint8), h.view(np.uint8)) for d, h in zip(device, host))
        rows.append({"kernel": name, "same": bool(same)})

    def noise(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    n, c, s = 4, 8, 49
    x, mean, scale, bias = noise(n, c, s), noise(c), noise(c), noise(c)
    gy, gx, sq, out = noise(n, c, s), np.zeros((n, c, s), np.float32), np.zeros((n, c, s), np.float32), \
        np.zeros((n, c, s), np.float32)
    half = noise(n, c, s).astype(np.float16)
    compare("relu_forward", lambda a: np.copyto(a[1], np.maximum(a[0], np.float32(0))),
            lambda a: gpu_kernels.relu_forward(xp, a[0], a[1], None), [x, out])
    compare("relu_backward", lambda a: np.multiply(a[1], a[0] > 0, out=a[2]),
            lambda a: gpu_kernels.relu_backward(xp, a[0], a[1], a[2], None), [x, gy, gx])
    compare("bn_center_square", lambda a: normalization._center_square(np, a[0], a[1], a[2], a[3]),
            lambda a: gpu_kernels.bn_center_square(xp, a[0], a[1], a[2], a[3], None), [x, mean, out, sq])
    compare("scale_channels", lambda a: normalization._scale_channels(np, a[0], a[1]),
            lambda a: gpu_kernels.scale_channels(xp, a[0], a[1], None), [x, scale])
    for label, y in (("", x), (" fp16", half)):
        compare("bn_input_grad" + label,
                lambda a: normalization._input_grad(np, a[0], a[1], a[2], a[3], a[4], a[5], np.empty_like(a[0])),
                lambda a: gpu_kernels.bn_input_grad(xp, a[0], a[1], a[2], a[3], a[4], a[5], None),
                [gy, y, mean, bias, scale, gx])
        compare("product" + label, lambda a: np.multiply(a[0], a[1], out=a[2]),
                lambda a: gpu_kernels.product(xp, a[0], a[1], a[2], None), [gy, y, out])
        compare("scale_grads" + label,
                lambda a: normalization._scale_grads(np, a[0], a[1], a[2].reshape(1, -1, 1), a[3], a[4]),
                lambda a: gpu_kernels.scale_grads(xp, a[0], a[1], a[2], a[3], a[4], None), [gy, y, scale, out, gx])
    compare("scale_bias", lambda a: np.add(np.multiply(a[0], a[1][:, None]), a[2][:, None], out=a[3]),
            lambda a: gpu_kernels.scale_bias(xp, a[0], a[1], a[2], a[3], None), [x, scale, bias, out])
    for geometry in ("kernel_size: 2 stride: 2", "kernel_size: 3 stride: 2 pad: 1", "kernel_size: 3 stride: 1 pad: 1"):
        shape = (2, 3, 11, 11)
        layer = make_layer(f'name: "p" type: "Pooling" bottom: "x" top: "y" pooling_param {{ pool: MAX {geometry} }}',
                           [shape], dtype=np.float32)
        xs, top = noise(*shape), layer.top_shapes[0]
        fws = {k: np.empty(d.shape, d.dtype or np.float32) for k, d in layer.workspace("forward").items()}
        bws = {k: np.empty(d.shape, d.dtype or np.float32) for k, d in layer.workspace("backward").items()}
        with jit.use_kernels(False):
            compare(f"max_forward {geometry}",
                    lambda a: layer.forward(np, [a[0]], [a[1]], [], {"argmax": a[2]}, fws),
                    lambda a: gpu_kernels.max_forward(xp, layer, a[0], a[1], a[2], None),
                    [xs, np.zeros(top, np.float32), np.zeros(top, np.uint8)])
            argmax = rng.integers(0, layer.kernel[0] * layer.kernel[1], top).astype(np.uint8)
            compare(f"max_backward {geometry}",
                    lambda a: layer.backward_from_index(np, a[0], a[1], a[2], bws),
                    lambda a: gpu_kernels.max_backward(xp, layer, a[0], a[1], a[2], None),
                    [argmax, noise(*top), np.zeros(shape, np.float32)])
    return rows


def dropout_fraction(xp, ratio=0.3, count=1 << 20):
    """Dropout's kernel on `count` ones: the kept fraction, and whether the mask is the one its
    stream gives in numpy (minigist.gpu.kernels.dropout_keep)."""
    rng = gpu_kernels.CounterRNG(5)
    x = xp.ones(count, dtype=np.float32)
    y, mask = xp.empty_like(x), xp.empty(count, dtype=np.bool_)
    gpu_kernels.dropout_forward(xp, x, y, mask, ratio, 1.0 / (1.0 - ratio), rng)
    host = np.array(to_numpy(mask))
    want = gpu_kernels.dropout_keep(rng.seed, 0, count, gpu_kernels.keep_threshold(ratio)).astype(bool)
    return {"kept": float(host.mean()), "expected": 1.0 - ratio, "matches_numpy_stream": bool(np.array_equal(host, want)),
            "scaled": bool(np.allclose(np.array(to_numpy(y))[host], 1.0 / (1.0 - ratio)))}


def _batches(net, count, seed=RNG_SEED):
    from .rules import relu_like_batch
    shape = net.train_graph.blobs[net.train_graph.nodes[0].tops[0]].shape
    classes = int(net.train_graph.nodes[-1].layer.bottom_shapes[0][1])
    return [relu_like_batch(shape, classes, seed + k) for k in range(count)]


def _path(model):
    return model if model.endswith(".prototxt") else os.path.join(MODELS_DIR, model + ".prototxt")


def _trained(model, device, gist, steps, batch_size, conv="im2col"):
    from ..net import Net
    net = Net(_path(model), batch_size=batch_size, device=device, gist=gist, conv=conv, update="fused", seed=0)
    batches = _batches(net, steps + 1)
    if net.gist.lossless:
        net.calibrate([batches[0]])
    losses = [net.train_step(*b) for b in batches[1:]]
    return net, losses


def train_cpu_and_gpu(model, steps=5, batch_size=32, modes=("none", "lossless", "lossy", "all"), device="gpu"):
    """`steps` steps of `model` on the CPU and on `device` under each Gist mode: the first
    step's relative loss difference (the forward pass alone), the worst over all steps, and
    whether lossless trains bit for bit like none there."""
    result = {"model": model, "steps": steps, "batch_size": batch_size, "modes": {}}
    weights = {}
    for mode in modes:
        _, cpu = _trained(model, "cpu", mode, steps, batch_size)
        net, gpu = _trained(model, device, mode, steps, batch_size)
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(cpu, gpu))
        first = abs(cpu[0] - gpu[0]) / max(abs(cpu[0]), 1e-30)
        result["modes"][mode] = {"cpu_losses": cpu, "gpu_losses": gpu, "first_relative_difference": first,
                                 "worst_relative_difference": worst,
                                 "report": {k: v for k, v in net.report()["gist"].items() if k.startswith("ssdc_")}}
        if mode in ("none", "lossless"):
            weights[mode] = {k: np.array(to_numpy(v)) for k, v in net.params().items()}
    for key in ("first_relative_difference", "worst_relative_difference"):
        result[key] = max(m[key] for m in result["modes"].values())
    if "none" in weights and "lossless" in weights:
        result["lossless_bit_identical_on_gpu"] = bool(
            result["modes"]["none"]["gpu_losses"] == result["modes"]["lossless"]["gpu_losses"]
            and all(np.array_equal(weights["none"][k], weights["lossless"][k]) for k in weights["none"]))
    return result


def optimized_training(model, steps=3, batch_size=32, device="gpu"):
    """Every lossless choice minigist.optimize can make for `model` (fp32, each encoding, shared
    and private recomputation; stash i takes its option i + shift, for shifts 0 and 1, SSDC at
    densities calibrated on the CPU), trained `steps` steps on `device`: the same losses and
    weights, bit for bit, as `none` there."""
    from ..costmodel import reference_model
    from ..net import Net
    from ..optimize import Optimizer, Settings
    from ..pipeline import Options
    path = _path(model)
    plain, expected = _trained(model, device, "none", steps, batch_size)
    weights = {k: np.array(to_numpy(v)) for k, v in plain.params().items()}
    calibrated = Net(path, batch_size=batch_size, gist="lossless", conv="im2col", update="fused", seed=0)
    batches = _batches(calibrated, steps + 1)
    calibrated.calibrate([batches[0]])
    optimizer = Optimizer(path, calibrated.options.replace(device="cpu"), reference_model())
    result = {"model": model, "steps": steps, "batch_size": batch_size, "none_losses": expected, "plans": [],
              "choices": {}}
    for shift in range(2):
        choice = {tensor: stash.options[(index + shift) % len(stash.options)]
                  for index, (tensor, stash) in enumerate(optimizer.stashes.items())}
        net = Net(path, plan=Settings(optimizer.options_for(choice)), device=device, seed=0)
        losses = [net.train_step(*b) for b in batches[1:]]
        for option in choice.values():
            result["choices"][option.name] = result["choices"].get(option.name, 0) + 1
        result["plans"].append({"losses": losses, "footprint_bytes": net.report()["footprint_bytes"],
                                "bit_identical": bool(losses == expected and all(
                                    np.array_equal(np.array(to_numpy(v)), weights[k]) for k, v in net.params().items()))})
    result["bit_identical"] = all(p["bit_identical"] for p in result["plans"])
    return result


def checkpoint_to_cpu(model, folder, device="gpu", batch_size=8):
    """Train 2 steps on `device`, save, load into a CPU net: evaluate gives the same outputs."""
    from ..net import Net
    net, _ = _trained(model, device, "all", 2, batch_size)
    path = os.path.join(folder, "weights.npz")
    net.save(path, with_momentum=True)
    cpu = Net(net.model, batch_size=batch_size, conv="im2col")
    cpu.load(path)
    images, labels = _batches(net, 1, seed=99)[0]
    on_device, on_cpu = net.evaluate(images, labels), cpu.evaluate(images, labels)
    differences = {key: float(np.max(np.abs(np.asarray(on_device[key], np.float64) - np.asarray(on_cpu[key], np.float64))))
                   for key in on_cpu}
    return {"model": model, "evaluate_outputs": sorted(on_cpu), "max_abs_difference": differences,
            "state_keys_equal": sorted(net.state()) == sorted(cpu.state())}


def pool_peak(model, gist, batch_size, cupy):
    """The bytes CuPy's pool holds during one step beyond the arena, recorded by a
    cupy.cuda.MemoryHook on every malloc and free, against the plan."""
    net, _ = _trained(model, "gpu", gist, 1, batch_size)
    images, labels = _batches(net, 1, seed=5)[0]
    net.train_step(images, labels)

    class Peak(cupy.cuda.MemoryHook):
        name = "minigist-peak"

        def __init__(self):
            self.current = self.peak = 0
            self.sizes = {}

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.sizes[mem_ptr] = mem_size
            self.current += mem_size
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.current -= self.sizes.pop(mem_ptr, mem_size)

    cupy.cuda.Device().synchronize()
    hook = Peak()
    with hook:
        net.train_step(images, labels)
        cupy.cuda.Device().synchronize()
    footprint = net.plans["train"].footprint_bytes
    return {"model": model, "gist": gist, "batch_size": batch_size, "plan_footprint_bytes": footprint,
            "arena_bytes": net.arena_bytes, "in_step_peak_bytes_outside_arena": hook.peak,
            "ratio_to_plan": (net.arena_bytes + hook.peak) / footprint}


def time_steps(model, batch_size, modes, repeats, cupy, torch=None):
    """Median step time per Gist mode on the GPU (CUDA events), and torch's own step (cuDNN)
    on the same net and weights where torch is given."""
    result = {"model": model, "batch_size": batch_size, "ms": {}}
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for mode in modes:
        net, _ = _trained(model, "gpu", mode, 1, batch_size)
        batches = _batches(net, 2, seed=21)
        for b in batches:
            net.train_step(*b)
        times = []
        for k in range(repeats):
            start.record()
            net.train_step(*batches[k % 2])
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        result["ms"][mode] = statistics.median(times)
    if "none" in result["ms"]:
        result["ratio_to_none"] = {m: t / result["ms"]["none"] for m, t in result["ms"].items()}
    if torch is not None:
        result["torch_ms"] = _torch_step_ms(model, batch_size, repeats, torch)
        result["ratio_to_torch"] = result["ms"].get("none", float("nan")) / result["torch_ms"]
    return result


def _torch_step_ms(model, batch_size, repeats, torch):
    import sys
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    sys.path.insert(0, bench)
    from step_vs_torch import TorchTwin, torch_step
    from ..net import Net
    net = Net(os.path.join(MODELS_DIR, model + ".prototxt"), batch_size=batch_size, conv="im2col", seed=0)
    twin = TorchTwin(net.train_graph, {k: np.array(v) for k, v in net.params().items()}).cuda()
    torch.backends.cudnn.benchmark = True
    optimizer = twin.optimizer(0.01, 0.9, 5e-4)
    batches = [(torch.from_numpy(i).cuda(), torch.from_numpy(np.asarray(l, np.int64)).cuda())
               for i, l in _batches(net, 2, seed=21)]
    for b in batches * 2:
        torch_step(twin, optimizer, *b)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for k in range(repeats):
        start.record()
        torch_step(twin, optimizer, *batches[k % 2])
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def wall(function, *args, **kwargs):
    """(result, seconds) of a call."""
    begin = time.perf_counter()
    value = function(*args, **kwargs)
    return value, time.perf_counter() - begin
