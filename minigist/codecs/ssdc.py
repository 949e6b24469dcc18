"""SSDC, Sparse Storage Dense Compute: a mostly-zero stash (a ReLU output feeding a conv) kept
sparse between its forward and backward use, decoded to dense before the backward.

Two formats; encode picks, per tensor, the one that is smaller for this tensor's nnz:

- "csr": flatten, pad to a multiple of 256, rows of 256 elements; per non-zero an 8-bit column
  index (uint8) and its value, plus int32 row pointers (rows + 1).
  Bytes: nnz * (1 + value bytes) + 4 * (rows + 1).
- "bitmap": 1 bit per element (non-zero or not, `numpy.packbits` bit order) + the non-zero
  values in order. Bytes: ceil(n / 8) + nnz * value bytes.

Both have the same value bytes, so csr wins exactly when nnz + 4*(rows+1) < ceil(n/8), i.e.
below about 10.9% non-zeros (ties go to bitmap). Values are stored as float32 bit patterns
("fp32", lossless) or in a DPR format ("fp16", "fp10", "fp8-e5m2", "fp8-e4m3": lossy, rounded as
DPR rounds; fp10 packs 3 values per uint32 word, so its value bytes are 4 * ceil(nnz / 3)).

"Non-zero" means a non-zero float32 bit pattern: -0.0 (and NaN) count as non-zeros and come
back bit-exact; only +0.0 is left out. A planner that measures density should count the same
way: `SSDC.count_nonzero(xp, x)`.

Encoded buffer: one uint32 array "data", the two formats laid over the same bytes (a union,
since one tensor uses one format):

    word 0: format (1 = csr, 2 = bitmap), word 1: nnz           (the header, 8 bytes)
    words 2 ..: values for `capacity` non-zeros                  (VW words)
    then csr: int32 row pointers (rows + 1 words), uint8 column indices (capacity bytes)
      or bitmap: ceil(n / 8) bytes
    words = 2 + VW + max(rows + 1 + ceil(capacity / 4), ceil(ceil(n / 8) / 4))

with capacity clipped to n, VW = ceil(value bytes for capacity values / 4). `formats` (default
both) restricts the choice, and the max above then runs over the allowed formats only. `encode` counts the
non-zeros first: when nnz > capacity it writes nothing (enc keeps a previous encoding) and
returns False, so the caller can take its fallback path; otherwise it returns True.

Work is done in chunks of `chunk` elements (whole rows; default CHUNK). The index list of one
chunk's non-zeros (`flatnonzero`: 8 bytes per non-zero of the chunk, numpy peaks near twice
that, so about 1 MiB at the default chunk) and a few row-sized arrays (chunk / 256 entries) are
transient allocations; everything tensor-sized goes through enc / out / declared workspace.
"""
import math

import numpy as np

from ..gpu import kernels as gpu_kernels
from ..layers.base import TensorDecl
from .base import Codec
from . import kernels
from .bits import bool_bytes, check_chunk, chunks, nelements, pack_words, unpack_words
from .dpr import DPR, FORMATS, value_nbytes

ROW = 256
CHUNK = 1 << 16            # elements per chunk: whole rows (a multiple of 256)
U8, U32 = np.uint8, np.uint32
HEADER_WORDS = 2
FORMAT_IDS = {"csr": 1, "bitmap": 2}
FORMAT_NAMES = {v: k for k, v in FORMAT_IDS.items()}


def _take(xp, a, idx, out):
    if xp is np:
        return np.take(a, idx, out=out, mode="clip")     # unbuffered; idx is in range
    return xp.take(a, idx, out=out)


_KEPT_VIEWS = 1024       # view sets an SSDC codec keeps (see _views)


class SSDC(Codec):
    """Sparse stash with a planned capacity (the most non-zeros its buffer holds).

    encoded(shape): {"data": uint32[words]} as laid out in the module docstring.
    workspace: encode {"words": uint64[ceil(min(n, chunk)/8)]}, decode the same plus
    {"index": int64[max(min(n, chunk), ceil((ceil(n/256) + 1)/2))]}; with DPR values also {"stage": float32[min(n, chunk)+2]}
    and the DPR workspace for that many values (names prefixed "dpr_").
    chunk: elements per step (default CHUNK, a multiple of 256; on a GPU pass a large one).
    """

    def __init__(self, capacity, value_format="fp32", formats=("csr", "bitmap"), chunk=None):
        self.chunk = check_chunk(CHUNK if chunk is None else chunk, ROW, "SSDC")
        capacity = int(capacity)
        if capacity < 0:
            raise ValueError(f"SSDC: capacity must be >= 0, got {capacity}")
        if value_format != "fp32" and value_format not in FORMATS:
            raise ValueError(f"SSDC: unknown value format {value_format!r}")
        formats = tuple(formats)
        if not formats or any(f not in FORMAT_IDS for f in formats):
            raise ValueError(f"SSDC: formats must be a non-empty subset of ('csr', 'bitmap'), "
                             f"got {formats!r}")
        self.capacity = capacity
        self.formats = formats
        self.value_format = value_format
        self.dpr = (None if value_format == "fp32"
                    else DPR(value_format, chunk=-(-(self.chunk + 2) // 3) * 3))
        self.lossless = self.dpr is None
        self.name = "ssdc" if self.dpr is None else f"ssdc-{value_format}"
        self._kept_views = {}

    # ---- sizes --------------------------------------------------------------------------
    @staticmethod
    def nbytes_for(n_elements, nnz, value_bytes=4):
        """Bytes of each format's data for a tensor of n_elements with nnz non-zeros.

        value_bytes: bytes per value (4 for fp32, 2 for fp16, ...), or a value-format name
        ("fp32", "fp16", "fp10", "fp8-e5m2", "fp8-e4m3") for the exact count (fp10: 4 bytes
        per 3 values, rounded up to whole words). The header (8 bytes) is not included."""
        n, nnz = int(n_elements), int(nnz)
        if isinstance(value_bytes, str):
            vb = value_nbytes(value_bytes, nnz)
        else:
            vb = math.ceil(nnz * value_bytes)
        rows = -(-n // ROW)
        return {"csr": nnz + vb + 4 * (rows + 1), "bitmap": -(-n // 8) + vb}

    def choose(self, n_elements, nnz):
        """The format encode picks among self.formats: "csr" when strictly smaller, else
        "bitmap"."""
        if len(self.formats) == 1:
            return self.formats[0]
        sizes = SSDC.nbytes_for(n_elements, nnz, 0)      # same value bytes in both
        return "csr" if sizes["csr"] < sizes["bitmap"] else "bitmap"

    data_dependent = True

    def density(self, xp, x):
        """Fraction of x that encode counts as non-zero (what the capacity must hold)."""
        return self.count_nonzero(xp, x) / max(1, x.size)

    @staticmethod
    def count_nonzero(xp, x):
        """Non-zeros as SSDC counts them (non-zero float32 bit patterns), as a Python int."""
        return int(xp.count_nonzero(x.reshape(-1).view(xp.uint32)))

    def _layout(self, n):
        cap = min(self.capacity, n)
        rows = -(-n // ROW)
        vw = -(-value_nbytes(self.value_format, cap) // 4)
        csr = rows + 1 + -(-cap // 4) if "csr" in self.formats else 0
        bitmap = -(-(-(-n // 8)) // 4) if "bitmap" in self.formats else 0
        return cap, rows, vw, HEADER_WORDS + vw + max(csr, bitmap)

    def encoded(self, shape):
        return {"data": TensorDecl((self._layout(nelements(shape))[3],), np.uint32)}

    def workspace(self, shape, phase):
        m = min(nelements(shape), self.chunk)
        ws = {"words": TensorDecl(((m + 7) // 8,), np.uint64)}
        if phase == "decode":
            # the GPU's bitmap decode reads "index" as int32 row offsets, one per 256-element
            # row of the whole tensor plus one: more than m int64 hold once n > 512 * chunk
            rows = -(-nelements(shape) // ROW)
            ws["index"] = TensorDecl((max(m, -(-(rows + 1) // 2)),), np.int64)
        if self.dpr is not None:
            ws["stage"] = TensorDecl((m + 2,), np.float32)
            for k, decl in self.dpr.flat_workspace(m + 2, phase).items():
                ws["dpr_" + k] = decl
        return ws

    def stored_nbytes(self, enc, shape):
        """Bytes actually used by the tensor of `shape` held in enc: the 8-byte header plus
        nbytes_for(...)[its format] (reads the header: a device sync on a GPU)."""
        fmt, nnz = self.header(enc)
        return 4 * HEADER_WORDS + self.nbytes_for(nelements(shape), nnz, self.value_format)[fmt]

    @staticmethod
    def header(enc):
        """(format name, nnz) of the tensor held in enc."""
        fmt, nnz = (int(v) for v in enc["data"][:HEADER_WORDS].tolist())
        if fmt not in FORMAT_NAMES:
            raise ValueError("SSDC: enc holds no encoded tensor")
        return FORMAT_NAMES[fmt], nnz

    # ---- views into enc -----------------------------------------------------------------
    def _views(self, xp, data, n):
        """The format views into data for an n-element tensor. Answers are kept per data array
        (with the array itself, so that its id cannot be reused) when data is a view into
        memory owned elsewhere, as a net's arena views are: a static plan hands the same arrays
        every step (PerSample one per sample), and making the views took a third of a small
        map's encode time. An array owning its memory is not kept (the codec would keep it
        alive), and a dynamic plan's fresh views empty the store now and then."""
        kept = self._kept_views.get(id(data))
        if kept is not None and kept[0] is data and kept[1] == n:
            return kept[2]
        views = self._make_views(xp, data, n)
        if data.base is not None:
            if len(self._kept_views) >= _KEPT_VIEWS:
                self._kept_views.clear()
            self._kept_views[id(data)] = (data, n, views)
        return views

    def _make_views(self, xp, data, n):
        cap, rows, vw, _ = self._layout(n)
        h = HEADER_WORDS
        if self.dpr is None:
            values = data[h:h + vw]
        else:
            values = data[h:h + vw].view(self.dpr.code_dtype)
        tail = data[h + vw:]
        return {
            "tail": tail,
            "values": values,
            "rowptr": tail[:rows + 1].view(xp.int32) if "csr" in self.formats else None,
            "cols": tail[rows + 1:].view(xp.uint8) if "csr" in self.formats else None,
            "bitmap": tail.view(xp.uint8),
        }

    def _kernel_serves(self, xp, *arrays):
        """Whether the compiled kernels do this call (not for fp10 values, 3 per word)."""
        return (self.dpr is None or self.dpr.per == 1) and kernels.active(xp, *arrays)

    @property
    def _kernel_args(self):
        if self.dpr is None:
            return kernels.FP32_PARAMS, False
        return kernels.dpr_params(self.dpr), True

    def _dpr_ws(self, ws):
        return {k[4:]: v for k, v in ws.items() if k.startswith("dpr_")}

    # ---- the contract -------------------------------------------------------------------
    def decoded_dtype(self, dtype):
        return np.dtype(np.float32)

    def encode(self, xp, x, enc, ws):
        return self.encode_measured(xp, x, enc, ws)[0]

    def encode_measured(self, xp, x, enc, ws):
        """encode, returning (True when it fit, else False; the density)."""
        if x.dtype != np.float32:
            raise TypeError(f"SSDC encodes float32, got {x.dtype}")
        u = x.reshape(-1).view(xp.uint32)
        n = u.size
        split = None
        compiled = self._kernel_serves(xp, u, enc["data"])
        if compiled:
            nnz, split = kernels.count_nonzero(u)     # per part, where the kernels run on threads
        else:
            nnz = int(xp.count_nonzero(u))
        return self._encode(xp, u, nnz, enc, ws, split, compiled), nnz / max(1, n)

    def encode_device(self, xp, x, enc, ws, stats, slot):
        """encode without reading anything back (GPU kernels, minigist/gpu/kernels.py): the
        count, the format and the fit are decided on the device. A tensor denser than the
        capacity gets the header's format 0 (decode writes zeros) and counts one in
        stats[2 * slot + 1]; stats[2 * slot] keeps the densest count (int32 device arrays)."""
        if x.dtype != np.float32:
            raise TypeError(f"SSDC encodes float32, got {x.dtype}")
        u = x.reshape(-1).view(xp.uint32)
        data = enc["data"]
        gpu_kernels.ssdc_encode(xp, self, u, data, self._views(xp, data, u.size), stats, slot,
                                (_encode_reference, (self, u, enc, ws, stats, slot)))

    def _encode(self, xp, u, nnz, enc, ws, split, compiled):
        n = u.size
        if nnz > min(self.capacity, n):
            return False
        fmt = self.choose(n, nnz)
        data = enc["data"]
        v = self._views(xp, data, n)
        if compiled:
            if fmt == "csr":
                kernels.ssdc_encode_csr(u, v["rowptr"], v["cols"], v["values"], nnz, *self._kernel_args)
            else:
                kernels.ssdc_encode_bitmap(u, v["bitmap"], v["values"], nnz, *self._kernel_args, split=split)
        else:
            self._store(xp, u, fmt, v, ws)
        data[0:1].fill(FORMAT_IDS[fmt])
        data[1:2].fill(nnz)
        return True

    def _store(self, xp, u, fmt, v, ws):
        """The ufunc path of encode: u's non-zeros into the views v of the chosen format."""
        n = u.size
        store = self._store_fp32 if self.dpr is None else self._store_dpr
        off = 0
        if fmt == "csr":
            rowptr, cols, words = v["rowptr"], v["cols"], ws["words"]
            rowptr[:1].fill(0)
            for c0, c1 in chunks(n, self.chunk):
                uc = u[c0:c1]
                mask = bool_bytes(xp, words, c1 - c0)
                xp.not_equal(uc, U32(0), out=mask)
                idx = xp.flatnonzero(mask)             # much faster on bool than on uint32
                m = idx.size
                store(xp, v["values"], uc, idx, off, ws)
                xp.bitwise_and(idx, np.int64(ROW - 1), out=cols[off:off + m], casting="unsafe")
                r0, rc = c0 // ROW, -(-(c1 - c0) // ROW)
                bounds = xp.arange(ROW, ROW * rc + 1, ROW)
                counts = xp.searchsorted(idx, bounds)
                xp.add(counts, off, out=rowptr[r0 + 1:r0 + rc + 1], casting="unsafe")
                off += m
        else:
            words, bitmap = ws["words"], v["bitmap"]
            for c0, c1 in chunks(n, self.chunk):
                uc = u[c0:c1]
                mask = bool_bytes(xp, words, c1 - c0)
                xp.not_equal(uc, U32(0), out=mask)
                idx = xp.flatnonzero(mask)
                store(xp, v["values"], uc, idx, off, ws)
                pack_words(xp, words, c1 - c0, bitmap[c0 // 8:])
                off += idx.size

    def decode(self, xp, enc, out, ws):
        if out.dtype != np.float32:
            raise TypeError(f"SSDC decodes to float32, got {out.dtype}")
        if gpu_kernels.serves(xp):
            o = out.reshape(-1).view(xp.uint32)
            rows = -(-o.size // ROW)
            scratch = ws["index"].view(xp.int32)
            if scratch.size < rows + 1:
                raise ValueError(f"SSDC: a decode workspace of {scratch.size} int32 holds no row offsets for "
                                 f"{o.size} elements")
            gpu_kernels.ssdc_decode(xp, self, enc["data"], self._views(xp, enc["data"], o.size), o, scratch,
                                    (_decode_reference, (self, enc, out, ws)))
            return
        fmt, nnz = self.header(enc)
        o = out.reshape(-1).view(xp.uint32)
        n = o.size
        if nnz > min(self.capacity, n) or fmt not in self.formats:
            # not this codec's encoding of a tensor of this size: nothing to decode safely
            raise ValueError(f"SSDC: enc holds {nnz} non-zeros in {fmt} for a capacity of "
                             f"{min(self.capacity, n)} in {'/'.join(self.formats)}")
        v = self._views(xp, enc["data"], n)
        if nnz and self._kernel_serves(xp, o, enc["data"]):
            if fmt == "csr":
                kernels.ssdc_decode_csr(v["rowptr"], v["cols"], v["values"], o, nnz, *self._kernel_args)
            else:
                kernels.ssdc_decode_bitmap(v["bitmap"], v["values"], o, nnz, *self._kernel_args)
            return
        load = self._load_fp32 if self.dpr is None else self._load_dpr
        if fmt == "bitmap":
            words, off = ws["words"], 0
            for c0, c1 in chunks(n, self.chunk):
                spread = unpack_words(xp, v["bitmap"][c0 // 8:], words, c1 - c0)
                xp.right_shift(spread, U8(7), out=spread)            # 0x80 -> 1: a bool
                idx = xp.flatnonzero(spread.view(xp.bool_))
                m = idx.size
                oc = o[c0:c1]
                oc.fill(0)
                if m:
                    oc[idx] = load(xp, v["values"], off, m, ws)
                off += m
            return
        rowptr, cols, index = v["rowptr"], v["cols"], ws["index"]
        for c0, c1 in chunks(n, self.chunk):
            r0, rc = c0 // ROW, -(-(c1 - c0) // ROW)
            rp = rowptr[r0:r0 + rc + 1]
            a, b = (int(t) for t in rp[[0, rc]].tolist())
            m = b - a
            oc = o[c0:c1]
            oc.fill(0)
            if not m:
                continue
            # the dense index of each non-zero: (its row) * 256 + its column. Rows come from a
            # cumulative sum over marks placed at the start of each non-empty row.
            nonempty = xp.flatnonzero(rp[1:] > rp[:-1])
            starts = rp[nonempty] - a
            base = nonempty * ROW
            step = xp.empty_like(base)
            step[:1] = base[:1]
            xp.subtract(base[1:], base[:-1], out=step[1:])
            k = index[:m]
            k.fill(0)
            k[starts] = step
            xp.cumsum(k, out=k)
            xp.add(k, cols[a:b], out=k, casting="unsafe")
            oc[k] = load(xp, v["values"], a, m, ws)

    # ---- values -------------------------------------------------------------------------
    @staticmethod
    def _store_fp32(xp, values, uc, idx, off, ws):
        _take(xp, uc, idx, values[off:off + idx.size])

    def _store_dpr(self, xp, codes, uc, idx, off, ws):
        """Round the chunk's non-zeros to the DPR format and write them as values off.. ."""
        dpr, per = self.dpr, self.dpr.per
        stage, dws = ws["stage"], self._dpr_ws(ws)
        head = off % per                  # fp10: values already in the first, shared word
        unit = off // per
        if head:
            dpr.decode_flat(xp, codes[unit:], stage[:head], dws)
        m = idx.size
        _take(xp, uc, idx, stage.view(xp.uint32)[head:head + m])
        dpr.encode_flat(xp, stage[:head + m], codes[unit:], dws)

    @staticmethod
    def _load_fp32(xp, values, off, m, ws):
        return values[off:off + m]

    def _load_dpr(self, xp, codes, off, m, ws):
        per = self.dpr.per
        head = off % per
        stage = ws["stage"]
        self.dpr.decode_flat(xp, codes[off // per:], stage[:head + m], self._dpr_ws(ws))
        return stage.view(xp.uint32)[head:head + m]


def _encode_reference(xp, codec, u, enc, ws, stats, slot):
    """What ssdc_encode's kernels write, on numpy: encode, or for a tensor over the capacity
    the header (0, nnz) and one overflow counted."""
    nnz = int(np.count_nonzero(u))
    if codec.encode(np, u.view(np.float32), enc, ws) is False:
        enc["data"][0:2] = (0, nnz)
        stats[2 * slot + 1] += 1
    stats[2 * slot] = max(int(stats[2 * slot]), nnz)


def _decode_reference(xp, codec, enc, out, ws):
    """What ssdc_decode's kernels write, on numpy: zeros for a tensor that did not fit."""
    if int(enc["data"][0]) == 0:
        out.fill(0)
    else:
        codec.decode(np, enc, out, ws)
