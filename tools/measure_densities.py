"""Measure the non-zero fraction of every SSDC candidate (ReLU outputs, and maps that keep
their zeros) of the ImageNet-size models, by calibration runs on real images, and write
models/densities/NAME.json for the plan-only Gist table (tools/gist_table.py).

    python tools/measure_densities.py [NAME ...]     # default: the seven ImageNet-size models

What is measured: forward and backward passes (no update) at batch 4 of real MNIST digits
(the bundled mnist5k set, resized with Pillow to the model's input size, gray copied to 3
channels, normalized), through freshly initialized weights (the model files' Caffe fillers,
seed 0). These are densities at initialization: trained networks are usually sparser.
"""
import json
import os
import sys
import time

import numpy as np
from PIL import Image

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import minigist  # noqa: E402

IMAGENET_MODELS = ["alexnet", "nin", "overfeat", "vgg16", "googlenet", "inception_v3", "resnet50"]


def digit_batches(size, batch_size, count):
    with np.load(os.path.join(ROOT, "minigist", "data", "mnist5k.npz"), allow_pickle=False) as data:
        images, labels = data["images"], data["labels"]
    out = []
    for b in range(count):
        picked = range(b * batch_size, (b + 1) * batch_size)
        batch = np.stack([np.asarray(Image.fromarray(images[i]).resize((size, size), Image.BILINEAR))
                          for i in picked]).astype(np.float32) / 255.0
        batch = (batch - 0.13) / 0.31
        out.append((np.repeat(batch[:, None], 3, axis=1), labels[list(picked)].astype(np.int64)))
    return out


def measure(name, batch_size=4, count=2):
    path = os.path.join(ROOT, "models", name + ".prototxt")
    net = minigist.Net(path, batch_size=batch_size, seed=0, gist="lossless")
    size = net.train_graph.input_shape[1]
    start = time.perf_counter()
    densities = net.calibrate(digit_batches(size, batch_size, count), margin=0.0)
    print(f"{name}: {len(densities)} tensors, mean density {np.mean(list(densities.values())):.3f}, "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return {"model": name, "batch_size": batch_size, "batches": count, "input_size": int(size),
            "data": "mnist5k digits resized to the input size, 3 channels, normalized",
            "weights": "Caffe fillers of the model file, seed 0 (untrained)",
            "density": {k: round(v, 6) for k, v in sorted(densities.items())}}


def main(names):
    for name in names or IMAGENET_MODELS:
        result = measure(name)
        with open(os.path.join(ROOT, "models", "densities", name + ".json"), "w") as out:
            json.dump(result, out, indent=1, sort_keys=True)
            out.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
