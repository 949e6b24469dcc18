"""Export torchvision CNNs to ONNX with BatchNorm kept in training form, for minigist's ONNX
front end (docs/onnx.md):

    python tools/export_torchvision.py runs/onnx            # resnet18, mobilenet_v2, ...
    python tools/export_torchvision.py runs/onnx --check    # and compare minigist's forward with torch's

Needs torch and torchvision, which minigist itself never imports (install them in a separate
environment: pip install torch torchvision onnx, then run this script with that environment's
python and minigist's checkout on the path, as below). The weights are torchvision's
initialization (weights=None: nothing is downloaded); the plans do not depend on them.

The export runs in training mode (torch.onnx.TrainingMode.TRAINING, the TorchScript exporter,
opset 17): each BatchNorm becomes a BatchNormalization with training_mode=1 and momentum 0.9
(PyTorch's 0.1), and Dropout keeps its training form. EfficientNet's stochastic depth, which
training mode would export as random-number operators, is replaced by the identity first (its
parameters are unchanged; only the random dropping of residual branches is left out).

--check builds each exported file with minigist (float64, the TEST phase: running statistics)
and compares its output with torch's model in eval mode (float64) on one random batch; then
one training step: the same model exported with Dropout off (p = 0) at 64x64, minigist's loss
and the gradient of every convolution and fully connected weight (--add-loss: a
SoftmaxWithLoss on random labels) against torch's cross entropy in training mode, float64.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODELS = ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0")


def build(name):
    """The torchvision model `name`, freshly initialized, stochastic depth removed."""
    import torch
    import torchvision
    from torchvision.ops import StochasticDepth
    model = getattr(torchvision.models, name)(weights=None)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, StochasticDepth):
                setattr(parent, child_name, torch.nn.Identity())
    return model


def export(model, path, size):
    import torch
    model.train()
    example = torch.randn(1, 3, size, size)
    torch.onnx.export(model, (example,), path, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      opset_version=17, do_constant_folding=False, input_names=["data"], output_names=["scores"])


def check(model, path, size, batch=2, seed=0):
    """The largest relative difference between minigist's TEST-phase forward of the file and
    torch's eval-mode forward, both in float64."""
    import torch
    import minigist
    x = np.random.default_rng(seed).standard_normal((batch, 3, size, size))
    with torch.no_grad():
        expected = model.double().eval()(torch.from_numpy(x)).numpy()
    net = minigist.Net(path, batch_size=batch, dtype=np.float64, update="fused")
    got = net.evaluate(x)["scores"]
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


def check_training(model, folder, name, size=64, batch=4, seed=0):
    """(loss difference, the largest relative difference of a conv / fc weight gradient)
    between minigist and torch for one training step, Dropout off, both float64 (a copy of
    `model`: its weights as initialized, whatever check() left it in)."""
    import copy
    import onnx
    import torch
    import minigist
    from minigist.onnx_import import node_names
    model = copy.deepcopy(model).float()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    path = os.path.join(folder, f"{name}_check.onnx")
    export(model, path, size)
    rng = np.random.default_rng(seed)
    x, labels = rng.standard_normal((batch, 3, size, size)), rng.integers(0, 1000, batch)
    model = model.double().train()
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()
    torch_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    net = minigist.Net(path, batch_size=batch, input_size=size, dtype=np.float64, add_loss=True, update="separate")
    ours = net.forward_backward(x, labels)
    grads = net.grads()
    graph = onnx.load(path).graph
    worst = 0.0
    for label, node in zip(node_names(onnx.load(path)), graph.node):
        if node.op_type in ("Conv", "Gemm") and node.input[1] in torch_grads:
            want = torch_grads[node.input[1]]
            worst = max(worst, float(np.max(np.abs(grads[f"{label}.weight"] - want)) / np.max(np.abs(want))))
    os.remove(path)
    return abs(ours - loss.item()), worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where the .onnx files go (created if missing)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--check", action="store_true", help="compare minigist's forward with torch's")
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    import torch
    torch.manual_seed(0)
    for name in args.models:
        model = build(name)
        path = os.path.join(args.folder, f"{name}.onnx")
        export(model, path, args.input_size)
        parameters = sum(p.numel() for p in model.parameters())
        line = f"{path}: {parameters:,} parameters (torchvision's count)"
        if args.check:
            line += f"; minigist's forward vs torch's: max difference {check(model, path, args.input_size):.2e} " \
                    f"of the largest output"
            loss_difference, gradient_difference = check_training(model, args.folder, name)
            line += f"; a training step: loss difference {loss_difference:.1e}, weight gradients within " \
                    f"{gradient_difference:.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
