"""Compiled CPU kernels for MAX pooling (numba; see minigist/jit.py for the switch).

They compute what Pooling's `xp` code computes, byte for byte: the same comparisons in the
same order, so the same outputs, argmax maps and gradients (tests/test_pool_kernels.py).
The `xp` code makes kh*kw passes over the whole tensor, each of several ufuncs, after a
padded copy of the input. The kernels work one (sample, channel) plane at a time: the
forward copies the plane into a bordered frame (one plane's worth, allocated once per call;
deinterleaved by the stride) where each window offset is one long contiguous loop; the
stride-1 overlapping backward does the same; the strided backward reads and writes the plane
where it lies (a window element outside the input is the `xp` code's padding: -inf never
wins, and what the `xp` code adds into its padded buffer outside the input is thrown away).
The layer still declares its own workspaces, so plans do not depend on numba.

Matching the `xp` code's order:
- forward: offset 0 initialises y and argmax; for each later offset k (row-major),
  `argmax = k where window > y` and `y = maximum(y, window)` (numpy's maximum: NaN
  propagates, and between equal values the second operand, the window's, is kept);
- backward: gx starts at zero (unless the windows tile the input) and receives, for k in
  increasing order, `gy * (argmax == k)` at each window's offset-k element: added, or
  stored when windows are disjoint. Every element of gx sees its additions in the same
  order as in the `xp` code, so the sums round alike.
"""
import numpy as np

from ..jit import numba

if numba is not None:
    _jit = numba.njit(cache=True, nogil=True, boundscheck=False)

    @_jit
    def _span(size, pad, stride, offset, count):
        """The outputs q in [lo, hi) whose window element `offset` lies inside the input:
        0 <= q * stride + offset - pad < size."""
        lo = 0
        first = pad - offset
        if first > 0:
            lo = (first + stride - 1) // stride
        last = size - 1 + pad - offset
        if last < 0:
            return 0, 0
        hi = min(count, last // stride + 1)
        return lo, max(lo, hi)

    _U = np.uint64

    @_jit
    def _window_maxima(frame, wide, codes, bases, ks, size):
        """wide, codes <- the running maximum and its argmax code over the window offsets k,
        offset k's elements at frame[bases[k]:bases[k] + size] (the `xp` code's order); ks[k]
        is k in the codes' dtype. Both stores are unconditional selects: a conditional store
        of a byte has no AVX2 form, and the loop then ran scalar, 8x slower than under
        AVX-512's masked stores."""
        for k in range(bases.size):
            base = _U(bases[k])
            if k == 0:
                for t in range(size):
                    wide[t] = frame[base + t]
                    codes[t] = ks[0]
                continue
            code = ks[k]
            for t in range(size):
                v = frame[base + t]
                best = wide[t]
                previous = codes[t]
                codes[t] = code if v > best else previous
                wide[t] = v if (v >= best or v != v) else best

    @_jit
    def _copy_out(wide, codes, width, y, argmax, s, ch, clamp, floor):
        oh, ow = y.shape[2], y.shape[3]
        for r in range(oh):
            for q in range(ow):
                v = wide[r * width + q]
                if clamp and v < floor:
                    v = floor
                y[s, ch, r, q] = v
                argmax[s, ch, r, q] = codes[r * width + q]

    @_jit
    def max_forward(x, y, argmax, ph, pw, sh, sw, kh, kw, clamp, low, floor):
        """y, argmax <- MAX pooling of x; `low` is -inf, `floor` Caffe's -FLT_MAX (applied
        when `clamp`: some window holds no input), both of y's dtype. Each plane is copied
        into a -inf bordered frame and the outputs are computed at the frame's row width
        (garbage columns past ow), so that each window offset is one long contiguous loop
        (rows of 8-32 outputs are too short for the vector loops); the valid columns are
        copied out at the end. With a stride the frame holds the plane deinterleaved: buffer
        row R at row-phase R % sh, row R // sh, and column C at column-phase C % sw, column
        C // sw, so that window offset (i, j) of consecutive outputs sits at consecutive
        places of its phases (reading every second element of a plain frame was 2.5x slower
        than numpy's strided passes)."""
        n, c, h, w = x.shape
        oh, ow = y.shape[2], y.shape[3]
        hb, wb = (oh - 1) * sh + kh, (ow - 1) * sw + kw     # the rows / cols windows reach
        rows, cols = -(-hb // sh), -(-wb // sw)              # per phase
        width = sw * cols
        frame = np.empty((sh * rows + 1) * width, x.dtype)  # + a row: the garbage columns' reads
        wide = np.empty(oh * width, y.dtype)
        codes = np.empty(oh * width, argmax.dtype)
        bases = np.array([((i % sh) * rows + i // sh) * width + (j % sw) * cols + j // sw
                          for i in range(kh) for j in range(kw)], np.int64)
        ks = np.empty(bases.size, argmax.dtype)
        for k in range(bases.size):
            ks[k] = k
        size = _U(oh * width)
        for s in range(n):
            for ch in range(c):
                frame[:] = low
                for a in range(min(h, hb - ph)):
                    # the input rows/cols that some window reaches (FLOOR mode may drop some)
                    row = a + ph
                    start = ((row % sh) * rows + row // sh) * width
                    if sw == 1:
                        for b in range(min(w, wb - pw)):
                            frame[start + b + pw] = x[s, ch, a, b]
                        continue
                    for phase in range(sw):     # buffer column m * sw + phase: input column - pw
                        dst = start + phase * cols
                        for m in range(cols):
                            b = m * sw + phase - pw
                            if b >= 0 and b < w and b + pw < wb:
                                frame[dst + m] = x[s, ch, a, b]
                _window_maxima(frame, wide, codes, bases, ks, size)
                _copy_out(wide, codes, width, y, argmax, s, ch, clamp, floor)

    @_jit
    def max_backward(index, gy, gx, ph, pw, sh, sw, kh, kw, disjoint, zero, one, nil):
        """gx <- the MAX pooling gradient from the argmax map; `zero` clears gx first; `one`
        and `nil` are 1 and 0 in gy's dtype (the mask as the `xp` code multiplies it)."""
        n, c, h, w = gx.shape
        oh, ow = gy.shape[2], gy.shape[3]
        if sh == 1 and sw == 1 and not disjoint:
            _max_backward_flat(index, gy, gx, ph, pw, kh, kw, one, nil)
            return
        if sw > 1:
            _max_backward_strided(index, gy, gx, ph, pw, sh, sw, kh, kw, disjoint, zero, one, nil)
            return
        for s in range(n):
            for ch in range(c):
                if zero:
                    for a in range(h):
                        for b in range(w):
                            gx[s, ch, a, b] = nil
                for i in range(kh):
                    for j in range(kw):
                        k = i * kw + j
                        lo, hi = _span(w, pw, sw, j, ow)
                        first, base, count = _U(lo), _U(lo + j - pw), _U(max(hi - lo, 0))
                        for r in range(oh):
                            row = r * sh + i - ph
                            if row < 0 or row >= h:
                                continue
                            if disjoint:
                                for t in range(count):
                                    gx[s, ch, row, base + t] = gy[s, ch, r, first + t] * (one if index[s, ch, r, first + t] == k else nil)
                            else:
                                for t in range(count):
                                    gx[s, ch, row, base + t] += gy[s, ch, r, first + t] * (one if index[s, ch, r, first + t] == k else nil)

    @_jit
    def _max_backward_strided(index, gy, gx, ph, pw, sh, sw, kh, kw, disjoint, zero, one, nil):
        """max_backward with a column stride: each plane's gradient is gathered in a frame
        that holds its columns deinterleaved by the stride (input column b at phase b % sw,
        place b // sw), where window offset j of consecutive outputs lands at consecutive
        places: contiguous loops, where writing every sw-th element of gx needs a scatter
        that AVX2 lacks (2.4x slower than AVX-512's). The frame starts as gx would (nil with
        `zero`) and takes the same stores and additions in the same order, then is copied
        back."""
        n, c, h, w = gx.shape
        oh, ow = gy.shape[2], gy.shape[3]
        cols = -(-w // sw)
        width = sw * cols
        frame = np.empty(h * width, gx.dtype)
        for s in range(n):
            for ch in range(c):
                if zero:        # else the windows tile the plane: every place is stored
                    frame[:] = nil
                for i in range(kh):
                    for j in range(kw):
                        k = i * kw + j
                        lo, hi = _span(w, pw, sw, j, ow)
                        count = _U(max(hi - lo, 0))
                        if count == 0:
                            continue
                        column = lo * sw + j - pw           # the input column of output lo
                        offset = (column % sw) * cols + column // sw
                        first = _U(lo)
                        for r in range(oh):
                            row = r * sh + i - ph
                            if row < 0 or row >= h:
                                continue
                            base = _U(row * width + offset)
                            if disjoint:
                                for t in range(count):
                                    frame[base + t] = gy[s, ch, r, first + t] * (one if index[s, ch, r, first + t] == k else nil)
                            else:
                                for t in range(count):
                                    frame[base + t] += gy[s, ch, r, first + t] * (one if index[s, ch, r, first + t] == k else nil)
                for a in range(h):
                    for phase in range(sw):
                        start = a * width + phase * cols
                        for m in range(cols):
                            column = m * sw + phase
                            if column < w:
                                gx[s, ch, a, column] = frame[start + m]

    @_jit
    def _max_backward_flat(index, gy, gx, ph, pw, kh, kw, one, nil):
        """Stride 1, overlapping windows: gy and the argmax map are laid out at the frame's
        width (see max_forward), their garbage columns 0 and a code no offset has, and
        each window offset adds into the zeroed frame in one long contiguous loop. A garbage
        column adds +0.0 to some frame element: a sum that starts at +0.0 is never -0.0, so
        that changes no bits. The frame's input part is copied out to gx at the end."""
        n, c, h, w = gx.shape
        oh, ow = gy.shape[2], gy.shape[3]
        hb, wb = oh + kh - 1, ow + kw - 1
        frame = np.empty(hb * wb + kw, gx.dtype)
        wide = np.zeros(oh * wb, gy.dtype)
        codes = np.empty(oh * wb, np.int64)
        codes[:] = -1
        size = _U(oh * wb)
        for s in range(n):
            for ch in range(c):
                frame[:] = nil
                for r in range(oh):
                    for q in range(ow):
                        wide[r * wb + q] = gy[s, ch, r, q]
                        codes[r * wb + q] = index[s, ch, r, q]
                for i in range(kh):
                    for j in range(kw):
                        k = i * kw + j
                        base = _U(i * wb + j)
                        for t in range(size):
                            frame[base + t] += wide[t] * (one if codes[t] == k else nil)
                for a in range(h):
                    for b in range(w):
                        inside = a + ph < hb and b + pw < wb
                        gx[s, ch, a, b] = frame[(a + ph) * wb + b + pw] if inside else nil
