"""Layers that move or combine data: Concat, Eltwise, Flatten, Split, Silence."""
import numpy as np

from .base import Layer, TensorDecl, register


def _axis(layer, axis, ndim):
    axis = axis + ndim if axis < 0 else axis
    if not 0 <= axis < ndim:
        layer.fail(f"axis out of range for {ndim}-D input")
    return axis


@register
class Concat(Layer):
    type = "Concat"
    keeps_zeros = True
    param_field = "concat_param"
    num_bottoms = (1, None)

    def setup(self, bottom_shapes):
        p = self.p
        if p.has("axis") and p.has("concat_dim"):
            self.fail("give either axis or the legacy concat_dim, not both")
        axis = p.get("axis", p.get("concat_dim", 1))
        first = bottom_shapes[0]
        self.axis = _axis(self, axis, len(first))
        for shape in bottom_shapes[1:]:
            if len(shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(shape, first)) if i != self.axis):
                self.fail(f"bottom shapes {[tuple(s) for s in bottom_shapes]} differ outside axis {self.axis}")
        self.bounds = np.cumsum([0] + [s[self.axis] for s in bottom_shapes]).tolist()
        out = list(first)
        out[self.axis] = self.bounds[-1]
        return [tuple(out)]

    def _slice(self, array, i):
        index = [slice(None)] * array.ndim
        index[self.axis] = slice(self.bounds[i], self.bounds[i + 1])
        return array[tuple(index)]

    def forward(self, xp, x, y, p, saved, ws):
        for i, bottom in enumerate(x):
            xp.copyto(self._slice(y[0], i), bottom)

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        for i, g in enumerate(gx):
            if g is not None:
                xp.copyto(g, self._slice(gy[0], i))


@register
class Eltwise(Layer):
    """SUM (with optional coeff per bottom), PROD and MAX over equally shaped bottoms."""
    type = "Eltwise"
    param_field = "eltwise_param"
    num_bottoms = (2, None)

    def setup(self, bottom_shapes):
        p = self.p
        self.operation = p.get("operation", "SUM")
        self.coeff = p.all("coeff") or [1.0] * len(bottom_shapes)
        if len(self.coeff) != len(bottom_shapes):
            self.fail(f"{len(bottom_shapes)} bottoms need as many coeff values, got {len(self.coeff)}")
        if self.operation != "SUM" and p.all("coeff"):
            self.fail("coeff applies only to operation SUM")
        for shape in bottom_shapes[1:]:
            if tuple(shape) != tuple(bottom_shapes[0]):
                self.fail(f"bottom shapes differ: {[tuple(s) for s in bottom_shapes]}")
        if self.operation == "PROD":
            self.keeps_bottoms = tuple(range(len(bottom_shapes)))
        elif self.operation == "MAX":
            self.saved = {"argmax": TensorDecl(bottom_shapes[0], np.uint8)}
        return [bottom_shapes[0]]

    def workspace(self, phase, gx_needed=None):
        if self.operation == "MAX":
            return {"mask": TensorDecl(self.top_shapes[0], np.bool_)}
        if self.operation == "SUM" and phase == "forward" and any(c != 1.0 for c in self.coeff[1:]):
            return {"scaled": TensorDecl(self.top_shapes[0])}
        return {}

    def inplace_safe(self, bottom_index, top_index):
        return self.operation == "SUM"

    def forward(self, xp, x, y, p, saved, ws):
        out = y[0]
        if self.operation == "SUM":
            xp.multiply(x[0], self.coeff[0], out=out)
            for bottom, coeff in zip(x[1:], self.coeff[1:]):
                if coeff == 1.0:
                    out += bottom
                else:
                    xp.multiply(bottom, coeff, out=ws["scaled"])
                    out += ws["scaled"]
            return
        if self.operation == "PROD":
            xp.multiply(x[0], x[1], out=out)
            for bottom in x[2:]:
                out *= bottom
            return
        # Caffe's order: bottom 0 wins over bottom 1 only when strictly greater (a tie, or a
        # NaN on either side, goes to bottom 1), then each later bottom wins only when
        # strictly greater than the running maximum (a tie stays)
        argmax, mask = saved["argmax"], ws["mask"]
        xp.greater(x[0], x[1], out=mask)
        xp.copyto(out, x[1])
        xp.copyto(out, x[0], where=mask)
        argmax.fill(1)
        xp.copyto(argmax, 0, where=mask)
        for i, bottom in enumerate(x[2:], start=2):
            xp.greater(bottom, out, out=mask)
            xp.copyto(out, bottom, where=mask)
            xp.copyto(argmax, i, where=mask)

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        # last bottom first: gx[0] may share memory with gy (in place), so it is written last
        for i in reversed(range(len(gx))):
            g = gx[i]
            if g is None:
                continue
            if self.operation == "SUM":
                xp.multiply(gy[0], self.coeff[i], out=g)
            elif self.operation == "PROD":
                xp.copyto(g, gy[0])
                for j, bottom in enumerate(x):
                    if j != i:
                        g *= bottom
            else:
                xp.equal(saved["argmax"], i, out=ws["mask"])
                xp.multiply(gy[0], ws["mask"], out=g)


def _address(xp, array):
    """The address of an array's first byte, on numpy, CuPy or the CuPy-rules checker."""
    if xp is np:
        return array.ctypes.data
    return xp.address(array) if hasattr(xp, "address") else array.data.ptr


class _NewShape(Layer):
    """A layer whose top holds its bottom's bytes in another shape (a copy; nothing to do in
    place, where the two are one buffer seen in two shapes)."""
    keeps_zeros = True

    def inplace_safe(self, bottom_index, top_index):
        return True

    @staticmethod
    def _copy(xp, source, target):
        if _address(xp, source) != _address(xp, target):
            xp.copyto(target, source.reshape(target.shape))

    def forward(self, xp, x, y, p, saved, ws):
        self._copy(xp, x[0], y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is not None:
            self._copy(xp, gy[0], gx[0])


@register
class Flatten(_NewShape):
    type = "Flatten"
    param_field = "flatten_param"

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        start = _axis(self, self.p.get("axis", 1), len(shape))
        end = _axis(self, self.p.get("end_axis", -1), len(shape))
        if end < start:
            self.fail("end_axis is before axis")
        return [tuple(shape[:start]) + (int(np.prod(shape[start:end + 1])),) + tuple(shape[end + 1:])]


@register
class Split(Layer):
    """Copies one blob to several tops (Caffe inserts it automatically; files rarely name it)."""
    type = "Split"
    keeps_zeros = True
    num_tops = (1, None)

    def setup(self, bottom_shapes):
        return [bottom_shapes[0]] * len(self.spec.tops)

    def forward(self, xp, x, y, p, saved, ws):
        for top in y:
            xp.copyto(top, x[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        xp.copyto(gx[0], gy[0])
        for g in gy[1:]:
            gx[0] += g


@register
class Silence(Layer):
    """Consumes blobs that nothing else uses; gives no output and no gradient."""
    type = "Silence"
    num_bottoms = (1, None)
    num_tops = (0, 0)

    def setup(self, bottom_shapes):
        return []

    def forward(self, xp, x, y, p, saved, ws):
        pass

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        for g in gx:
            if g is not None:
                g.fill(0)


class _Broadcast(Layer):
    """An element-wise binary operation with NumPy's (ONNX's) broadcasting: two bottoms, or
    one bottom and a constant operand the model file fixes (the parameter "operand", state:
    never learned), e.g. a squeeze-and-excitation scale (N, C, 1, 1) applied to (N, C, H, W).
    A bottom's gradient is summed over the axes it was broadcast along."""
    num_bottoms = (1, 2)

    def setup(self, bottom_shapes):
        shapes = [tuple(s) for s in bottom_shapes]
        operand = self.spec.initial.get("operand")
        if len(shapes) == 1:
            if operand is None:
                self.fail("one bottom needs a constant operand")
            shapes.append(tuple(operand.shape))
            self.add_param("operand", operand.shape, {"type": "values", "values": operand}, learnable=False)
        elif operand is not None:
            self.fail("two bottoms and a constant operand: give one of them")
        try:
            top = tuple(int(d) for d in np.broadcast_shapes(*shapes))
        except ValueError:
            self.fail(f"shapes {shapes[0]} and {shapes[1]} do not broadcast together")
        self.operand_shapes = shapes
        # each operand's shape with leading 1s to the top's rank, and the axes it is broadcast along
        self.padded = [(1,) * (len(top) - len(s)) + s for s in shapes]
        self.reduce_axes = [tuple(a for a, (d, t) in enumerate(zip(padded, top)) if d != t) for padded in self.padded]
        return [top]

    def _operands(self, x, p):
        return (x[0], x[1]) if len(x) == 2 else (x[0], p[0])

    def inplace_safe(self, bottom_index, top_index):
        return tuple(self.bottom_shapes[0]) == tuple(self.top_shapes[0])

    def _reduce_into(self, xp, values, index, gx):
        """gx (bottom `index`'s shape) <- values (the top's shape) summed over the broadcast axes."""
        axes = self.reduce_axes[index]
        if not axes:
            if values is not gx:
                xp.copyto(gx, values)
            return
        xp.sum(values, axis=axes, keepdims=True, out=gx.reshape(self.padded[index]))


@register
class Add(_Broadcast):
    """ONNX's Add with broadcasting: y = a + b."""
    type = "Add"
    caffe_type = False       # ONNX's operator: read from .onnx files only

    def forward(self, xp, x, y, p, saved, ws):
        a, b = self._operands(x, p)
        xp.add(a, b, out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        for index in reversed(range(len(gx))):      # gx[0] may be gy itself: written last
            if gx[index] is not None:
                self._reduce_into(xp, gy[0], index, gx[index])


@register
class Mul(_Broadcast):
    """ONNX's Mul with broadcasting: y = a * b. Backward keeps both bottoms (the gradient of
    each is gy times the other), or none when b is a constant (gx = gy * b)."""
    type = "Mul"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    keeps_zeros = True      # 0 * b is 0 (for a finite b): zeros stay zeros

    def setup(self, bottom_shapes):
        top = super().setup(bottom_shapes)
        self.keeps_bottoms = (0, 1) if len(bottom_shapes) == 2 else ()
        return top

    def workspace(self, phase, gx_needed=None):
        needed = gx_needed if gx_needed is not None else (True,) * len(self.bottom_shapes)
        if phase == "backward" and any(need and self.reduce_axes[i] for i, need in enumerate(needed)):
            return {"product": TensorDecl(self.top_shapes[0])}
        return {}

    def forward(self, xp, x, y, p, saved, ws):
        a, b = self._operands(x, p)
        xp.multiply(a, b, out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        operands = self._operands(x, p)
        for index in reversed(range(len(gx))):      # gx[0] may be gy itself: written last
            if gx[index] is None:
                continue
            other = operands[1 - index]
            if not self.reduce_axes[index]:
                xp.multiply(gy[0], other, out=gx[index])
                continue
            product = ws["product"]
            xp.multiply(gy[0], other, out=product)
            self._reduce_into(xp, product, index, gx[index])


@register
class Reshape(_NewShape):
    """Caffe's Reshape: the axes from `axis` (num_axes of them; -1: all the rest) take the
    shape's dims, where 0 copies the input's dim at that place and one -1 is inferred. The
    bytes do not change: the top is a copy in the new shape (the ONNX front end's Reshape,
    Flatten, Squeeze and Unsqueeze, with their shapes resolved at import)."""
    type = "Reshape"
    param_field = "reshape_param"

    def setup(self, bottom_shapes):
        shape = tuple(int(d) for d in bottom_shapes[0])
        p = self.p
        target = p.get("shape")
        dims = [int(d) for d in target.all("dim")] if target is not None else []
        axis = int(p.get("axis", 0))
        num_axes = int(p.get("num_axes", -1))
        start = axis + len(shape) + 1 if axis < 0 else axis
        if not 0 <= start <= len(shape):
            self.fail(f"axis {axis} out of range for input shape {shape}")
        end = len(shape) if num_axes == -1 else start + num_axes
        if num_axes < -1 or end > len(shape):
            self.fail(f"num_axes {num_axes} out of range for input shape {shape} from axis {axis}")
        out = []
        for index, dim in enumerate(dims):
            if dim == 0:
                if start + index >= len(shape):
                    self.fail(f"dim {index} is 0 (copy) but the input {shape} has no axis {start + index}")
                out.append(shape[start + index])
            elif dim < -1:
                self.fail(f"dim {dim} is not allowed (only -1, 0 and positive sizes)")
            else:
                out.append(dim)
        out = list(shape[:start]) + out + list(shape[end:])
        total = int(np.prod(shape, dtype=np.int64))
        if out.count(-1) > 1:
            self.fail("more than one dim is -1")
        if -1 in out:
            known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
            if known == 0 or total % known:
                self.fail(f"cannot infer the -1 dim of {tuple(dims)} for input shape {shape}")
            out[out.index(-1)] = total // known
        if int(np.prod(out, dtype=np.int64)) != total:
            self.fail(f"shape {tuple(out)} does not hold the {total} values of input shape {shape}")
        return [tuple(out)]


@register
class Transpose(Layer):
    """y = x with its axes permuted by `perm` (default: reversed), ONNX's Transpose (ShuffleNet's
    channel shuffle); backward applies the inverse permutation."""
    type = "Transpose"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    param_field = "transpose_param"
    keeps_zeros = True

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        perm = [int(a) for a in self.p.all("perm")] or list(reversed(range(len(shape))))
        if sorted(perm) != list(range(len(shape))):
            self.fail(f"perm {perm} is not a permutation of the {len(shape)} axes of input shape {shape}")
        self.perm = tuple(perm)
        self.inverse = tuple(int(a) for a in np.argsort(perm))
        return [tuple(shape[a] for a in perm)]

    def forward(self, xp, x, y, p, saved, ws):
        xp.copyto(y[0], x[0].transpose(self.perm))

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is not None:
            xp.copyto(gx[0], gy[0].transpose(self.inverse))


@register
class Pad(Layer):
    """Zero padding: `pads` gives the zeros before each axis, then after each axis (ONNX's
    order), all >= 0. Backward takes the gradient of the input's part."""
    type = "Pad"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    param_field = "pad_param"
    keeps_zeros = True

    def setup(self, bottom_shapes):
        shape = tuple(int(d) for d in bottom_shapes[0])
        pads = [int(v) for v in self.p.all("pads")]
        if len(pads) != 2 * len(shape):
            self.fail(f"{len(pads)} pads for a {len(shape)}-D input {shape}: give 2 per axis")
        if min(pads) < 0:
            self.fail(f"negative pads {pads} (cropping) are not supported")
        before, after = pads[:len(shape)], pads[len(shape):]
        self.inside = tuple(slice(b, b + d) for b, d in zip(before, shape))
        return [tuple(d + b + a for d, b, a in zip(shape, before, after))]

    def forward(self, xp, x, y, p, saved, ws):
        y[0].fill(0)
        xp.copyto(y[0][self.inside], x[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is not None:
            xp.copyto(gx[0], gy[0][self.inside])
