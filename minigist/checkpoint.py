"""Writing .npz files atomically, reading ones that may be damaged, and what a checkpoint
records to be trusted.

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
from .prototxt import parse_file

DIGEST_KEY = "__digest__"

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
    first, then every layer in file order. A checkpoint stores it to notice an edited model."""
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
