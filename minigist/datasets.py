"""Training data for train.py: the bundled MNIST-5k digits, a folder of images, or synthetic.

    data = load_dataset("mnist5k", shape=(3, 32, 32), classes=10)
    data.train.images   # uint8 (N, C, H, W), already at the model's input size
    data.heldout.labels # int64 (M,)
    order = data.epoch_order(rng)                               # one epoch's shuffled indices
    images, labels = data.train_batch(data.epoch_batch(order, 0, 32), rng, crop_pad=2, flip=False)
    for images, labels, real in data.eval_batches(data.heldout, 32): ...

Every source ends as uint8 images at the model's input shape (C, H, W), split into a training
part and a held-out part (stratified: the same fraction of every class, chosen by a fixed
`split_seed` so that the held-out set does not change with --seed). Batches come out as float32,
normalized per channel with the mean and standard deviation of the training part.

- mnist5k: 5,000 real MNIST digits (28x28 grayscale, minigist/data/mnist5k.npz). The digits are
  zero-padded to the input size when it is at most 36 (28 -> 32 centres them as LeNet did),
  resized with Pillow otherwise; a 3-channel model gets the gray channel three times.
- a folder `root/class_name/*.png|jpg|jpeg|bmp|gif|webp`: one subfolder per class (sorted names
  are labels 0, 1, ...); each image is decoded with Pillow, converted to RGB (or L for a
  1-channel model; 16-bit samples by their high byte, alpha dropped), its shorter side resized
  to the input size, then centre-cropped. Float images and PNGs with cut-short pixel data are
  refused. `native_channels` says how many channels the data have (1: all gray).
- synthetic: random images whose label is carried by a class-specific pattern.
"""
import os
import warnings

import numpy as np

from .errors import MinigistError

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED = {"mnist5k": os.path.join(HERE, "data", "mnist5k.npz")}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
# random-crop padding for the bundled digits: none by default. Measured on the default run
# (ResNet-20, 4-5 epochs): shifting the digits by up to 2 pixels slowed the fit more than it
# helped held-out accuracy (96.4% vs 97.0% after 4 epochs); --crop-pad turns it on.
MNIST_CROP_PAD = 0
# Pillow modes that hold more than 8 bits per sample: scaled to 8 bits by their high byte
# (Pillow's own conversion to L clips them at 255, which turns a 16-bit image near-white)
WIDE_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class Split:
    """Images (uint8, N x C x H x W) and integer labels of one part of a dataset."""

    def __init__(self, images, labels):
        self.images = images
        self.labels = labels

    def __len__(self):
        return len(self.labels)


class Dataset:
    def __init__(self, name, train, heldout, class_names, flip_default, crop_pad_default):
        self.name = name
        self.train = train
        self.heldout = heldout
        self.class_names = list(class_names)
        self.flip_default = flip_default            # horizontal flips make sense for this data
        self.crop_pad_default = crop_pad_default    # random-crop padding, in pixels
        channels = train.images.shape[1]
        mean, std = np.zeros(channels), np.ones(channels)
        if len(train):
            for c in range(channels):     # one channel at a time: no float copy of the whole split
                plane = train.images[:, c]
                mean[c] = plane.mean(dtype=np.float64) / 255.0
                std[c] = plane.std(dtype=np.float64) / 255.0
        self.mean = mean.astype(np.float32)
        self.std = np.where(std > 1e-6, std, 1.0).astype(np.float32)

    @property
    def classes(self):
        return len(self.class_names)

    def describe(self):
        return (f"{self.name}: {len(self.train)} training / {len(self.heldout)} held-out images, "
                f"{self.classes} classes, {tuple(self.train.images.shape[1:])}")

    def fingerprint(self):
        """What a checkpoint records to check that a resumed run sees the same data."""
        return {"name": self.name, "train": len(self.train), "heldout": len(self.heldout),
                "classes": self.class_names, "shape": list(self.train.images.shape[1:]),
                "train_label_sum": int(self.train.labels.sum()),
                "train_pixel_sum": int(self.train.images.sum(dtype=np.int64))}

    def train_sample(self, size, seed=0):
        """A fixed, stratified sample of `size` training images for the training-accuracy
        figure: every class in proportion (largest remainders), the same for every --seed."""
        return Split(*_take(self.train, stratified_sample(self.train.labels, size, seed)))

    # ---- batches -----------------------------------------------------------------------
    def normalize(self, images):
        """uint8 (B, C, H, W) -> float32, per-channel (x / 255 - mean) / std."""
        out = images.astype(np.float32) * np.float32(1.0 / 255.0)
        out -= self.mean[None, :, None, None]
        out /= self.std[None, :, None, None]
        return out

    def iters_per_epoch(self, batch_size):
        return -(-len(self.train) // batch_size)

    def epoch_order(self, rng):
        """The training order of one epoch (drawn from `rng`)."""
        return rng.permutation(len(self.train))

    def epoch_batch(self, order, index, batch_size):
        """Indices of batch `index` of an epoch in `order`: the last batch of an epoch is filled
        up with the first samples of the same order, so every batch is full and every sample is
        seen at least once per epoch."""
        start = index * batch_size
        chosen = order[start:start + batch_size]
        while len(chosen) < batch_size:
            chosen = np.concatenate([chosen, order[:batch_size - len(chosen)]])
        return chosen

    def train_batch(self, indices, rng, crop_pad=0, flip=False, part=None):
        """Augmented, normalized training images and float32 labels for `indices`; the random
        crop offsets and flips come from `rng`. `part` (a slice of `indices`): only those
        samples are read, with the draws made for all of `indices`, so that `rng` moves on as
        for the whole batch (each rank of a data-parallel run reads its part of the global one)."""
        part = slice(None) if part is None else part
        images = self.train.images[indices[part]]
        if crop_pad:
            images = random_crop(images, crop_pad, rng, len(indices), part)
        if flip:
            flips = (rng.random(len(indices)) < 0.5)[part]
            images[flips] = images[flips, :, :, ::-1]
        return self.normalize(images), self.train.labels[indices[part]].astype(np.float32)

    def eval_batches(self, split, batch_size, limit=None):
        """(images, labels, real) over a split in order; the last batch is padded with copies
        of its first sample and `real` says how many of its samples are real."""
        count = len(split) if limit is None else min(limit, len(split))
        for start in range(0, count, batch_size):
            stop = min(start + batch_size, count)
            indices = np.arange(start, stop)
            real = len(indices)
            if real < batch_size:
                indices = np.concatenate([indices, np.full(batch_size - real, start)])
            yield (self.normalize(split.images[indices]), split.labels[indices].astype(np.float32), real)


def random_crop(images, pad, rng, drawn=None, part=slice(None)):
    """Each image shifted by up to `pad` pixels in each direction (zero fill), i.e. a random
    crop of the zero-padded image at the original size. The offsets are drawn for `drawn`
    images (None: these) and `part` of them applied (the images of a rank's part of a batch)."""
    n, c, h, w = images.shape
    drawn = n if drawn is None else drawn
    dy = rng.integers(0, 2 * pad + 1, size=drawn)[part]
    dx = rng.integers(0, 2 * pad + 1, size=drawn)[part]
    # the part of each image that stays inside the crop is copied; the padded image itself is
    # never built (its size grows with the square of `pad`)
    out = np.zeros_like(images)
    for i in range(n):
        # the crop's first row and column in the image's coordinates (negative: in the padding)
        sy, sx = int(dy[i]) - pad, int(dx[i]) - pad
        y0, y1 = max(0, -sy), min(h, h - sy)
        x0, x1 = max(0, -sx), min(w, w - sx)
        if y0 < y1 and x0 < x1:
            out[i, :, y0:y1, x0:x1] = images[i, :, y0 + sy:y1 + sy, x0 + sx:x1 + sx]
    return out


# ---- splitting ---------------------------------------------------------------------------
def stratified_split(labels, holdout, seed):
    """(train indices, held-out indices): `holdout` of every class (rounded, at least one when
    the class has two or more samples and holdout > 0), chosen by `seed`; each part sorted."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = int(round(len(members) * holdout))
        if holdout > 0 and len(members) >= 2:
            count = min(max(count, 1), len(members) - 1)
        else:
            count = min(count, len(members) - 1)
        held.append(members[:count])
        train.append(members[count:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(held))


def stratified_sample(labels, size, seed):
    """Sorted indices of `size` samples (all when size >= len(labels)): each class's share
    rounded by largest remainders, its members chosen by `seed`."""
    if size >= len(labels):
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * size / len(labels)
    quota = np.floor(exact).astype(np.int64)
    for index in np.argsort(-(exact - quota), kind="stable")[:size - int(quota.sum())]:
        quota[index] += 1
    chosen = [rng.permutation(np.flatnonzero(labels == label))[:count]
              for label, count in zip(classes, quota)]
    return np.sort(np.concatenate(chosen))


def _take(split, indices):
    return split.images[indices], split.labels[indices]


def _make_dataset(name, images, labels, class_names, holdout, split_seed, flip, crop_pad):
    train_idx, held_idx = stratified_split(labels, holdout, split_seed)
    return Dataset(name, Split(images[train_idx], labels[train_idx]),
                   Split(images[held_idx], labels[held_idx]), class_names, flip, crop_pad)


# ---- sources -----------------------------------------------------------------------------
def load_dataset(spec, shape, classes, holdout=0.2, split_seed=0, seed=0, synthetic_size=None):
    """`spec` is a bundled name, 'synthetic', or a folder; `shape` the model's (C, H, W) input;
    `classes` the number of classes the model predicts."""
    if len(shape) != 3:
        raise MinigistError(f"--data: the model's input is {'x'.join(map(str, shape))} per sample; train.py "
                            f"feeds images (channels x height x width): feed other inputs through the library "
                            f"(Net.train_step)")
    channels, height, width = shape
    if channels not in (1, 3):
        raise MinigistError(f"--data: the model takes {channels}-channel images; only 1 (gray) "
                            f"or 3 (RGB) channels can be fed from images")
    if not 0 <= holdout < 1:
        raise MinigistError(f"--holdout: expected a fraction in [0, 1), got {holdout}")
    crop_pad = max(1, min(height, width) // 8)
    if spec == "synthetic":
        return synthetic(shape, classes, holdout, split_seed, seed, synthetic_size)
    if spec in BUNDLED:
        return mnist(BUNDLED[spec], spec, shape, classes, holdout, split_seed)
    if os.path.isdir(spec):
        images, labels, names = read_folder(spec, shape)
        if len(names) > classes:
            raise MinigistError(f"--data: {spec} has {len(names)} class folders but the model "
                                f"predicts {classes} classes")
        return _make_dataset(os.path.basename(os.path.normpath(spec)) or spec, images, labels, names,
                             holdout, split_seed, True, crop_pad)
    check_spec(spec)


def check_spec(spec):
    """A one-line error where `spec` names no data: not a bundled name, 'synthetic' or a
    folder (load_dataset's check, for runs that read no images: --plan-only, --summary)."""
    if spec == "synthetic" or spec in BUNDLED or os.path.isdir(spec):
        return
    if os.path.exists(spec):
        raise MinigistError(f"--data: {spec} is not a folder (expected a folder with one "
                            f"subfolder of images per class)")
    raise MinigistError(f"--data: no such folder or bundled dataset: {spec} "
                        f"(bundled: {', '.join(sorted(BUNDLED))}, synthetic)")


GRAY_MODES = ("1", "L", "LA", "La") + WIDE_GRAY_MODES


def native_channels(spec):
    """The channel count the data itself has, as Caffe's Data layer takes it from its LMDB:
    1 for the bundled digits, 1 for a folder whose images are all gray (Pillow modes 1, L, LA,
    16-bit gray), 3 for any other folder; None for synthetic data or a spec that is not data
    (load_dataset then says what is wrong). Reads image headers only."""
    if spec in BUNDLED:
        return 1
    if not os.path.isdir(spec):
        return None
    from PIL import Image
    for folder, _, names in sorted(os.walk(spec)):
        for name in sorted(names):
            if name.startswith(".") or not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            try:
                with Image.open(os.path.join(folder, name)) as image:
                    if image.mode not in GRAY_MODES:
                        return 3
            except (OSError, ValueError, SyntaxError):
                continue        # read_folder reports the file when it decodes it
    return 1


def mnist(path, name, shape, classes, holdout, split_seed):
    channels, height, width = shape
    with np.load(path, allow_pickle=False) as stored:
        digits, labels = stored["images"], stored["labels"].astype(np.int64)
    if classes < 10:
        raise MinigistError(f"--data {name}: has 10 classes, the model predicts only {classes}")
    n, h, w = digits.shape
    if height >= h and width >= w and height <= h + 8 and width <= w + 8:
        images = np.zeros((n, height, width), dtype=np.uint8)
        top, left = (height - h) // 2, (width - w) // 2
        images[:, top:top + h, left:left + w] = digits
    else:
        from PIL import Image
        images = np.stack([np.asarray(Image.fromarray(d).resize((width, height), Image.BILINEAR))
                           for d in digits])
    images = np.repeat(images[:, None], channels, axis=1)
    return _make_dataset(name, images, labels, [str(i) for i in range(10)], holdout, split_seed,
                         False, MNIST_CROP_PAD)


def synthetic(shape, classes, holdout, split_seed, seed, size=None):
    """Random uint8 images: a class pattern plus noise, so a net can learn the labels."""
    channels, height, width = shape
    if size is None:
        per_image = channels * height * width
        size = max(4 * classes, min(1000, (64 << 20) // per_image))
    rng = np.random.default_rng(seed + 12345)
    patterns = rng.integers(0, 256, size=(classes, channels, height, width)).astype(np.float32)
    labels = np.arange(size) % classes
    rng.shuffle(labels)
    noise = rng.standard_normal((size, channels, height, width)).astype(np.float32) * 40.0
    images = np.clip(patterns[labels] * 0.5 + 64.0 + noise, 0, 255).astype(np.uint8)
    return _make_dataset("synthetic", images, labels.astype(np.int64),
                         [f"class{i}" for i in range(classes)], holdout, split_seed, False, 0)


def read_folder(root, shape):
    """uint8 (N, C, H, W) images, int64 labels and the class names of a class-subfolder tree."""
    try:
        entries = sorted(os.listdir(root))
    except OSError as exc:
        raise MinigistError(f"--data: cannot read folder {root}: {exc.strerror}") from None
    entries = [e for e in entries if not e.startswith(".")]
    class_dirs = [e for e in entries if os.path.isdir(os.path.join(root, e))]
    loose = [e for e in entries if e not in class_dirs and e.lower().endswith(IMAGE_EXTENSIONS)]
    if not class_dirs:
        if loose:
            raise MinigistError(f"--data: {root} holds images but no class subfolders "
                                f"(expected {root}/CLASS_NAME/IMAGE)")
        raise MinigistError(f"--data: {root} is empty (expected one subfolder of images per class)")
    if loose:
        raise MinigistError(f"--data: {os.path.join(root, loose[0])} is outside the class "
                            f"subfolders (expected {root}/CLASS_NAME/IMAGE)")
    files, labels = [], []
    for label, name in enumerate(class_dirs):
        folder = os.path.join(root, name)
        try:
            members = sorted(f for f in os.listdir(folder) if not f.startswith("."))
        except OSError as exc:
            raise MinigistError(f"--data: cannot read class folder {folder}: {exc.strerror}") from None
        images = [f for f in members if f.lower().endswith(IMAGE_EXTENSIONS)
                  and os.path.isfile(os.path.join(folder, f))]
        for f in members:
            path = os.path.join(folder, f)
            if f.lower().endswith(IMAGE_EXTENSIONS) and os.path.islink(path) and not os.path.exists(path):
                raise MinigistError(f"--data: {path} is a link to nothing ({os.readlink(path)})")
        if not images:
            raise MinigistError(f"--data: class folder {folder} has no images "
                                f"({', '.join(IMAGE_EXTENSIONS)}); every class needs at least one")
        files.extend(os.path.join(folder, f) for f in images)
        labels.extend([label] * len(images))
    channels, height, width = shape
    out = np.empty((len(files), channels, height, width), dtype=np.uint8)
    for index, path in enumerate(files):
        out[index] = decode_image(path, channels, height, width)
    return out, np.asarray(labels, dtype=np.int64), class_dirs


def open_image(path):
    """Image.open, refusing an image over Pillow's MAX_IMAGE_PIXELS (89.5 million pixels):
    Pillow only warns up to twice that, and a training image that large is a damaged or
    hostile header (a decompression bomb), not a photo to shrink to the input size."""
    from PIL import Image
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(path)


# modes with a colour model or sample type that cannot be turned into 8-bit gray or RGB here
REFUSED_MODES = {"F": "32-bit floating-point samples", "YCbCr": None, "LAB": None, "HSV": None}


def decode_image(path, channels, height, width):
    """One image file -> uint8 (C, H, W): decoded to 8-bit gray or RGB (16-bit samples by
    their high byte, alpha dropped as Caffe's OpenCV reader does), the shorter side resized to
    fit, centre-cropped."""
    from PIL import Image, UnidentifiedImageError
    try:
        with open_image(path) as image:
            image.load()
            if image.format == "PNG":
                check_png_pixel_data(path, image)
            image = to_8bit(image, channels, path)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise MinigistError(f"--data: cannot decode image {path}: {reason}") from None
    w, h = image.size
    scale = max(width / w, height / h)
    size = (max(width, int(round(w * scale))), max(height, int(round(h * scale))))
    if size != (w, h):
        image = image.resize(size, Image.BILINEAR)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    image = image.crop((left, top, left + width, top + height))
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[None]
    else:
        array = array.transpose(2, 0, 1)
    return array


def to_8bit(image, channels, path):
    """A decoded Pillow image -> an 8-bit L (channels 1) or RGB (channels 3) image."""
    from PIL import Image
    mode = image.mode
    if mode in REFUSED_MODES:
        what = REFUSED_MODES[mode] or f"the {mode} colour model"
        raise MinigistError(f"--data: cannot decode image {path}: Pillow mode {mode} "
                            f"({what}) is not supported; convert it to 8-bit RGB or gray")
    if mode in WIDE_GRAY_MODES:
        samples = np.asarray(image).astype(np.int64)
        if samples.min() < 0 or samples.max() > 65535:
            raise MinigistError(f"--data: cannot decode image {path}: Pillow mode {mode} holds "
                                f"values outside 0..65535; only 16-bit gray is supported")
        image = Image.fromarray((samples >> 8).astype(np.uint8), "L")
    elif mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")     # the palette's colours; the alpha is then dropped
    return image.convert("RGB" if channels == 3 else "L")


def check_png_pixel_data(path, image):
    """Refuse a PNG whose compressed pixel data end early: Pillow fills the missing rows with
    zeros when the zlib stream itself is complete."""
    import struct
    import zlib
    with open(path, "rb") as stream:
        content = stream.read()
    position, idat = 8, []
    header = None
    while position + 8 <= len(content):
        length, kind = struct.unpack(">I4s", content[position:position + 8])
        body = content[position + 8:position + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        position += 12 + length
    if header is None:
        return
    expected = png_data_bytes(*header[:4], interlaced=header[6] == 1)
    inflater = zlib.decompressobj()
    try:
        got = len(inflater.decompress(b"".join(idat), expected + 1))
    except zlib.error:
        return            # Pillow decoded it: leave the judgement of a damaged stream to it
    if got < expected:
        raise MinigistError(f"--data: cannot decode image {path}: its pixel data are cut short "
                            f"({got:,} of {expected:,} bytes)")


PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}      # colour type -> samples per pixel
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2))                             # (x0, y0, dx, dy) of each interlace pass


def png_data_bytes(width, height, depth, colour_type, interlaced):
    """The size of a PNG's decompressed pixel data: per row a filter byte and the packed samples."""
    bits = depth * PNG_SAMPLES.get(colour_type, 1)

    def rows(w, h):
        return 0 if w == 0 or h == 0 else h * (1 + (w * bits + 7) // 8)
    if not interlaced:
        return rows(width, height)
    return sum(rows(-(-(width - x0) // dx) if width > x0 else 0,
                    -(-(height - y0) // dy) if height > y0 else 0)
               for x0, y0, dx, dy in ADAM7)
