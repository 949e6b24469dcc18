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


@register
class Flatten(Layer):
    type = "Flatten"
    keeps_zeros = True
    param_field = "flatten_param"

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        start = _axis(self, self.p.get("axis", 1), len(shape))
        end = _axis(self, self.p.get("end_axis", -1), len(shape))
        if end < start:
            self.fail("end_axis is before axis")
        return [tuple(shape[:start]) + (int(np.prod(shape[start:end + 1])),) + tuple(shape[end + 1:])]

    def inplace_safe(self, bottom_index, top_index):
        return True

    def forward(self, xp, x, y, p, saved, ws):
        xp.copyto(y[0], x[0].reshape(y[0].shape))

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is not None:
            xp.copyto(gx[0], gy[0].reshape(gx[0].shape))


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
