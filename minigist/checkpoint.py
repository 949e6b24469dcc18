"""Writing .npz files atomically, reading ones that may be damaged, and a training run's
checkpoint folder: its format, its atomic write and the checks a resume makes.

A zip member's CRC-32 is checked only when the member is read to its end, and a flipped byte
in an .npy header can shorten what is read; so every file minigist writes also carries a
SHA-256 digest of its arrays (names, dtypes, shapes, bytes), checked on reading. Any damage
the zip layer or the digest notices is one MinigistError naming the file.
"""
import hashlib
import json
import os
import struct
import tempfile
import tokenize
import zipfile
import zlib

import numpy as np

from .errors import MinigistError
from . import onnx_import
from .gpu.kernels import CounterRNG
from .prototxt import parse_file

DIGEST_KEY = "__digest__"
CHECKPOINT_NAME = "checkpoint.npz"
CHECKPOINT_FORMAT = 2     # 2: a digest of the arrays, the model's definition, the changes made on resumes

# what a damaged zip or .npy member raises inside np.load and zipfile
_DAMAGE = (OSError, ValueError, KeyError, EOFError, IndexError, TypeError, OverflowError,
           UnicodeDecodeError, NotImplementedError, zipfile.BadZipFile, zipfile.LargeZipFile,
           RuntimeError, MemoryError, zlib.error, struct.error, SyntaxError, tokenize.TokenError)
# RuntimeError: an "encrypted" flag bit; SyntaxError, TokenError: a damaged .npy header


def arrays_digest(arrays):
    """SHA-256 (hex) over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(json.dumps([name, value.dtype.str, list(value.shape)]).encode("utf-8"))
        digest.update(value.tobytes())
    return digest.hexdigest()


def with_digest(arrays):
    """`arrays` plus their digest, as np.savez takes them."""
    out = dict(arrays)
    out[DIGEST_KEY] = np.frombuffer(arrays_digest(arrays).encode("ascii"), dtype=np.uint8)
    return out


def save_npz_atomic(path, arrays):
    """np.savez to a temporary file in the same folder, fsync, then rename over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(handle, "wb") as out:
            np.savez(out, **arrays)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def read_npz(path, what, require_digest=False):
    """{name: array} of an .npz file, its digest checked (and removed) where it has one.
    `what` starts every message ("--resume: ...", a weights file's path)."""
    try:
        with open(path, "rb") as file:
            head = file.read(6)
        # numpy reads a file that is neither a zip archive nor an .npy array as a pickle, and
        # would refuse it as one: a text file is named for what it is not
        if not head.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):
            raise MinigistError(f"{what}: {path} is not an .npz file (it does not begin as a zip archive does)")
        with np.load(path, allow_pickle=False) as stored:
            if not isinstance(stored, np.lib.npyio.NpzFile):
                raise MinigistError(f"{what}: {path} is a single .npy array, not an .npz archive")
            values = {key: stored[key] for key in stored.files}
    except FileNotFoundError:
        raise MinigistError(f"{what}: {path} not found") from None
    except MinigistError:
        raise
    except _DAMAGE as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        if "pickle" in str(exc):    # numpy's hint to load it unsafely is no advice to follow here
            reason = "reading it would unpickle Python objects, which is never done"
        raise MinigistError(f"{what}: {path} is damaged or not an .npz file ({exc.__class__.__name__}: "
                            f"{reason})") from None
    stored_digest = values.pop(DIGEST_KEY, None)
    if stored_digest is None:
        if require_digest:
            raise MinigistError(f"{what}: {path} has no digest of its arrays (damaged, or not written by minigist)")
        return values
    if stored_digest.dtype != np.uint8 or stored_digest.ndim != 1:
        raise MinigistError(f"{what}: {path} is damaged (its digest entry is not a digest)")
    if stored_digest.tobytes() != arrays_digest(values).encode("ascii"):
        raise MinigistError(f"{what}: {path} is damaged: its arrays do not match the digest written with them")
    return values


# ---- metadata schema -----------------------------------------------------------------------
def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TYPES = {
    "int": _is_int,
    "count": lambda v: _is_int(v) and v >= 0,
    "number": _is_number,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "any": lambda v: True,
}


def check_fields(record, schema, where):
    """Raise ValueError naming the first key of `record` that is missing or of the wrong type.
    `schema`: {key: type name, or (type name, ...) for alternatives; "?" ending a name: may be null}."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not an object")
    for key, kinds in schema.items():
        if key not in record:
            raise ValueError(f"{where} has no '{key}'")
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        value = record[key]
        if not any((value is None and kind.endswith("?")) or _TYPES[kind.rstrip("?")](value) for kind in kinds):
            raise ValueError(f"{where}: '{key}' is {json.dumps(value)[:40]}, expected {' or '.join(kinds)}")


# ---- the model a checkpoint was trained on -------------------------------------------------
def _canonical(value):
    """A parsed prototxt value as JSON-ready data, without line numbers (comments, spacing
    and line breaks do not change it)."""
    if hasattr(value, "fields"):
        return [[name, _canonical(inner)] for name, inner, _ in value.fields]
    return value


def model_definition(path):
    """[[layer name or '(net)', canonical JSON text], ...] of a model file: the net-level fields
    first, then every layer in file order. A checkpoint stores it to notice an edited model.
    An ONNX file gives its nodes instead (minigist.onnx_import.model_definition)."""
    if onnx_import.is_onnx(path):
        return onnx_import.model_definition(path)
    net = parse_file(path)
    header = [[name, _canonical(value)] for name, value, _ in net.fields if name not in ("layer", "layers")]
    out = [["(net)", json.dumps(header, sort_keys=True)]]
    for field in ("layer", "layers"):
        for layer in net.all(field):
            out.append([str(layer.get("name", "?")), json.dumps(_canonical(layer), sort_keys=True)])
    return out


def _flat(tree, prefix=""):
    """[(dotted field path, scalar value)] of a canonical tree."""
    out = []
    counts = {}
    for name, value in tree:
        index = counts.get(name, 0)
        counts[name] = index + 1
        key = f"{prefix}{name}" + (f"[{index}]" if index else "")
        if isinstance(value, list):
            out.extend(_flat(value, key + "."))
        else:
            out.append((key, value))
    return out


def _shown(value):
    return "(absent)" if value is None else json.dumps(value)


def model_change(then, now):
    """None if the two model definitions are the same, else one phrase saying what changed
    first (a layer added, removed, or a field of a layer)."""
    if then == now:
        return None
    old, new = dict((n, t) for n, t in then), dict((n, t) for n, t in now)
    removed = [n for n, _ in then if n not in new]
    added = [n for n, _ in now if n not in old]
    if removed:
        return f"layer '{removed[0]}' was removed"
    if added:
        return f"layer '{added[0]}' was added"
    for name, text in now:
        if old[name] == text:
            continue
        before, after = dict(_flat(json.loads(old[name]))), dict(_flat(json.loads(text)))
        where = "the net-level fields" if name == "(net)" else f"layer '{name}'"
        for key in list(before) + [k for k in after if k not in before]:
            if before.get(key) != after.get(key):
                return f"{where}: {key} was {_shown(before.get(key))}, is now {_shown(after.get(key))}"
        return f"{where} changed"
    return "the layer order changed"


# ---- a training run's checkpoint folder ----------------------------------------------------
# the configuration a checkpoint records; a resumed run takes it for the settings it does not give
RESUME_KEYS = ("model", "data", "holdout", "input_size", "batch_size", "crop_pad", "flip", "lr", "warmup", "lr_step",
               "lr_gamma", "momentum", "weight_decay", "bn_average", "seed", "gist", "dpr", "conv", "threads",
               "add_loss", "memory_budget", "optimize", "update")
CONFIG_EXTRA_KEYS = ("epochs", "iters", "alloc", "device")
# keys a checkpoint written before they were recorded lacks: its run resumes as it did then
OPTIONAL_CONFIG_KEYS = ("memory_budget", "optimize", "update")
# what a resume may change: the learning-rate schedule (e.g. after a NaN loss)
RESUME_CHANGEABLE = ("lr", "warmup", "lr_step", "lr_gamma")

# what a checkpoint's metadata holds, key by key (check_fields)
META_SCHEMA = {"format": "int", "config": "dict", "data": "dict", "iteration": "count", "epoch": "count",
               "batch_in_epoch": "count", "data_rng": "dict?", "net_rng": "dict?", "history": "list",
               "epoch_losses": "list", "digest": "str", "model": "list", "changes": "list"}
# and, from a run with --optimize, "optimizer": the plan's choices (check_optimized_plan)


def json_default(value):
    """numpy scalars and arrays as JSON (json.dumps's `default`)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value)}")


def checkpoint_path(folder):
    return os.path.join(folder, CHECKPOINT_NAME)


def write_checkpoint(folder, state, meta, order):
    """Write FOLDER's checkpoint atomically: the net's `state`, the epoch `order` (None at an
    epoch end) and `meta` with the digest of the arrays added."""
    arrays = dict(state)
    arrays["__order__"] = np.asarray(order if order is not None else [], dtype=np.int64)
    meta = dict(meta, digest=arrays_digest(arrays))
    arrays["__meta__"] = np.frombuffer(json.dumps(meta, default=json_default).encode("utf-8"), dtype=np.uint8)
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


def read_checkpoint(folder, check_config=None):
    """(meta dict, order array or None, {state key: array}) of DIR's checkpoint, or None if
    there is none. A damaged file, metadata that is not what a training run writes, arrays that
    do not match their digest, or values that are not finite: one MinigistError naming the file.
    `check_config(config)` raises ValueError for a configuration value out of its range (the
    command line passes its flags' own checks)."""
    path = checkpoint_path(folder)
    if not os.path.exists(path):
        return None
    values = read_npz(path, "--resume")
    try:
        meta = json.loads(values.pop("__meta__").tobytes().decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("the metadata is not an object")
        if meta.get("format") == CHECKPOINT_FORMAT:
            check_meta(meta, check_config)
    except (KeyError, ValueError, TypeError) as exc:
        raise MinigistError(f"--resume: {path} has damaged metadata ({exc})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise MinigistError(f"--resume: {path} has checkpoint format {meta.get('format')}, "
                            f"this train.py reads format {CHECKPOINT_FORMAT}")
    if "__order__" not in values or meta["digest"] != arrays_digest(values):
        raise MinigistError(f"--resume: {path} is damaged: its arrays do not match the digest written with them")
    order = values.pop("__order__")
    bad = next((key for key, value in values.items() if value.dtype.kind not in "fiub"
                or (value.dtype.kind == "f" and not np.all(np.isfinite(value)))), None)
    if bad is not None:
        raise MinigistError(f"--resume: {path}: '{bad}' holds NaN, infinite or non-numeric values; it cannot be "
                            f"resumed (start over with --overwrite and a lower --lr)")
    return meta, (order if order.size and order.ndim == 1 and order.dtype.kind == "i" else None), values


def check_meta(meta, check_config=None):
    """Raise ValueError naming the first field of a checkpoint's metadata that is missing or
    not of the kind a training run writes (and, through `check_config`, out of range)."""
    check_fields(meta, META_SCHEMA, "the metadata")
    check_fields(meta["config"], {key: "any?" for key in RESUME_KEYS + CONFIG_EXTRA_KEYS
                                  if key not in OPTIONAL_CONFIG_KEYS}, "the configuration")
    if check_config is not None:
        check_config(meta["config"])
    if meta.get("optimizer") is not None:
        check_optimized_plan(meta["optimizer"])
    for name in ("data_rng", "net_rng"):
        if meta[name] is not None:     # the bit generator's own check of its state
            rng = CounterRNG(0) if meta[name].get("bit_generator") == CounterRNG.NAME else np.random.default_rng(0)
            rng.bit_generator.state = meta[name]
    if not all(isinstance(loss, (int, float)) and not isinstance(loss, bool) for loss in meta["epoch_losses"]):
        raise ValueError("the metadata's epoch_losses are not all numbers")
    if not all(isinstance(record, dict) for record in meta["history"] + meta["changes"]):
        raise ValueError("the metadata's history is not a list of objects")
    if not all(isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)
               for item in meta["model"]):
        raise ValueError("the metadata's model definition is not a list of [layer, definition] pairs")


def check_optimized_plan(entry):
    """Raise ValueError unless `entry` is the choices of an optimized plan as a training run
    records them (OptimizedPlan.to_json's overrides, recompute, recompute_shared, chunk_bytes,
    and its micro-batched front and SGD update, where it has the keys)."""
    check_fields(entry, {"overrides": "dict", "recompute": "list", "recompute_shared": "list",
                         "chunk_bytes": "count?"}, "the optimized plan")
    names = list(entry["overrides"].items()) + [(t, "") for t in entry["recompute"] + entry["recompute_shared"]]
    if not all(isinstance(name, str) and isinstance(choice, str) for name, choice in names):
        raise ValueError("the optimized plan names a tensor or an encoding that is not a string")
    if not set(entry["recompute_shared"]) <= set(entry["recompute"]):
        raise ValueError("the optimized plan shares a recomputed copy of a tensor it does not recompute")
    front = entry.get("microbatch")
    if front is not None and not (isinstance(front, list) and len(front) == 2 and isinstance(front[0], str)
                                  and type(front[1]) is int and front[1] > 0):
        raise ValueError(f"the optimized plan's 'microbatch' is {front!r}, not [BLOB, SAMPLES]")
    spans = entry.get("spans", [])
    if not (isinstance(spans, list) and all(isinstance(span, list) and len(span) == 3 and isinstance(span[0], str)
                                            and isinstance(span[1], str) and type(span[2]) is int and span[2] > 0
                                            for span in spans)):
        raise ValueError(f"the optimized plan's 'spans' is {spans!r}, not a list of [START, THROUGH, SAMPLES]")
    if entry.get("update", "fused") not in ("fused", "blocked"):
        raise ValueError(f"the optimized plan's 'update' is {entry['update']!r}, not fused or blocked")


def checkpoint_iteration(folder):
    """The iteration DIR's checkpoint holds (read from its metadata alone), or None."""
    try:
        with np.load(checkpoint_path(folder), allow_pickle=False) as stored:
            meta = json.loads(stored["__meta__"].tobytes().decode("utf-8"))
        iteration = meta["iteration"]
        return iteration if isinstance(iteration, int) else None
    except Exception:   # noqa: BLE001  (only a hint for a message: any damage means "unknown")
        return None


def restore_state(net, values, path):
    """Put a checkpoint's arrays into `net`, refusing any that the net does not have or holds
    in another shape."""
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


def apply_checkpoint_config(options, given, meta, folder):
    """Take the checkpoint's configuration for the settings not `given`; returns {key: [old, new]}
    for the schedule settings given with a new value (any other difference is refused)."""
    stored = meta["config"]
    changed = {}
    for key in RESUME_KEYS:
        if key not in stored or not hasattr(options, key):
            continue
        if key == "flip" and getattr(options, key) == "auto":
            given = given - {"flip"}
        if key in given and getattr(options, key) != stored[key]:
            if key in RESUME_CHANGEABLE:
                changed[key] = [stored[key], getattr(options, key)]
                continue
            flag = "--" + key.replace("_", "-")
            if stored[key] is None or isinstance(stored[key], bool):    # a flag alone, or no value then
                made, keep = (f"with {flag}", "the checkpoint's") if stored[key] else (f"without {flag}", "without it")
            else:
                shown = (lambda v: f"{v:,} B") if key == "memory_budget" else str
                made = f"with {flag} {shown(stored[key])}, not {shown(getattr(options, key))}"
                keep = "the checkpoint's"
            raise MinigistError(f"--resume: the checkpoint in {folder} was made {made} (drop {flag} to continue "
                                f"with {keep})")
        setattr(options, key, stored[key])
    if "epochs" not in given and "iters" not in given:
        options.epochs, options.iters = stored.get("epochs"), stored.get("iters")
    return changed


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
