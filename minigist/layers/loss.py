"""Softmax, SoftmaxWithLoss and Accuracy, with Caffe's axis, ignore_label and normalization."""
import numpy as np

from ..errors import MinigistError
from .base import Layer, TensorDecl, register

_FLT_MIN = float(np.finfo(np.float32).tiny)


def _split_axis(layer, shape, axis):
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis < len(shape):
        layer.fail(f"axis out of range for input shape {tuple(shape)}")
    outer = int(np.prod(shape[:axis]))
    inner = int(np.prod(shape[axis + 1:]))
    return axis, outer, shape[axis], inner


def softmax_into(xp, x3, y3):
    """Numerically stable softmax of x3 (outer, classes, inner) over axis 1, written into y3."""
    xp.subtract(x3, x3.max(axis=1, keepdims=True), out=y3)
    xp.exp(y3, out=y3)
    y3 /= y3.sum(axis=1, keepdims=True)


@register
class Softmax(Layer):
    type = "Softmax"
    param_field = "softmax_param"

    def setup(self, bottom_shapes):
        self.axis, self.outer, self.classes, self.inner = _split_axis(
            self, bottom_shapes[0], self.p.get("axis", 1))
        self.keeps_tops = (0,)
        return [bottom_shapes[0]]

    def _3d(self, array):
        return array.reshape(self.outer, self.classes, self.inner)

    def forward(self, xp, x, y, p, saved, ws):
        softmax_into(xp, self._3d(x[0]), self._3d(y[0]))

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        y3, gy3, gx3 = self._3d(y[0]), self._3d(gy[0]), self._3d(gx[0])
        xp.multiply(gy3, y3, out=gx3)
        dot = gx3.sum(axis=1, keepdims=True)
        xp.subtract(gy3, dot, out=gx3)
        gx3 *= y3


def check_labels(labels, layer):
    """The label check of `layer` (a loss or accuracy layer) on a batch's host labels."""
    layer.label_range(np.asarray(labels).reshape(layer.outer, layer.inner))


class _LabelLayer(Layer):
    """Shared checks for layers with (scores, labels) bottoms."""
    num_bottoms = (2, 2)

    def setup_labels(self, bottom_shapes, axis):
        self.axis, self.outer, self.classes, self.inner = _split_axis(self, bottom_shapes[0], axis)
        count = int(np.prod(bottom_shapes[1]))
        if count != self.outer * self.inner:
            self.fail(f"label count {count} does not match {self.outer * self.inner} predictions "
                      f"of shape {tuple(bottom_shapes[0])}")
        self.ignore_label = self.p.get("ignore_label") if self.p.has("ignore_label") else None

    def propagates_down(self, index):
        return index == 0

    def label_range(self, labels):
        """Raise MinigistError unless every label (a numpy array) but the ignored ones is a
        class index."""
        labels = np.asarray(labels).astype(np.int64)
        valid = labels if self.ignore_label is None else labels[labels != self.ignore_label]
        if valid.size and (int(valid.min()) < 0 or int(valid.max()) >= self.classes):
            raise MinigistError(f"layer '{self.name}': labels must be in [0, {self.classes}), "
                                f"got values from {int(valid.min())} to {int(valid.max())}")

    def labels(self, xp, label_blob):
        """Labels as (outer, inner) integers, checked against the class count on the CPU. On a
        GPU the check would read the labels back (a host sync per layer and step): there the
        net checks each batch's labels on the host as it feeds them (check_labels)."""
        labels = label_blob.reshape(self.outer, self.inner).astype(np.int64)
        if xp is np:
            self.label_range(labels)
        return labels

    def gather(self, xp, array3, labels):
        """array3[o, labels[o, i], i] for all (o, i); ignored labels pick class 0."""
        safe = labels if self.ignore_label is None else xp.where(labels == self.ignore_label, 0, labels)
        outer_index = xp.arange(self.outer).reshape(-1, 1)
        inner_index = xp.arange(self.inner).reshape(1, -1)
        return array3[outer_index, safe, inner_index], safe, outer_index, inner_index


@register
class SoftmaxWithLoss(_LabelLayer):
    type = "SoftmaxWithLoss"
    param_field = "loss_param"
    num_tops = (1, 2)
    is_loss = True

    def setup(self, bottom_shapes):
        softmax_param = self.spec.msg.get("softmax_param")
        axis = softmax_param.get("axis", 1) if softmax_param is not None else 1
        self.setup_labels(bottom_shapes, axis)
        p = self.p
        if p.has("normalization"):
            self.normalization = p.get("normalization")
        elif p.has("normalize"):
            self.normalization = "VALID" if p.get("normalize") else "BATCH_SIZE"
        else:
            self.normalization = "VALID"
        self.saved = {"prob": TensorDecl(bottom_shapes[0])}
        self.keeps_bottoms = (1,)
        tops = [()]
        if len(self.spec.tops) == 2:
            tops.append(bottom_shapes[0])
        return tops

    def _normalizer(self, xp, labels):
        if self.normalization == "FULL":
            count = self.outer * self.inner
        elif self.normalization == "VALID":
            if self.ignore_label is not None:   # counted on the device: no host sync
                return xp.maximum((labels != self.ignore_label).sum(), 1).astype(np.float32)
            count = self.outer * self.inner
        elif self.normalization == "BATCH_SIZE":
            count = self.outer
        else:
            count = 1
        return max(1.0, float(count))

    def forward(self, xp, x, y, p, saved, ws):
        prob3 = saved["prob"].reshape(self.outer, self.classes, self.inner)
        softmax_into(xp, x[0].reshape(self.outer, self.classes, self.inner), prob3)
        labels = self.labels(xp, x[1])
        picked, _, _, _ = self.gather(xp, prob3, labels)
        log_prob = xp.log(xp.maximum(picked, _FLT_MIN))
        if self.ignore_label is not None:
            log_prob = xp.where(labels == self.ignore_label, 0, log_prob)
        y[0][...] = -log_prob.sum() / self._normalizer(xp, labels)
        if len(y) == 2:
            xp.copyto(y[1], saved["prob"])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        labels = self.labels(xp, x[1])
        gx3 = gx[0].reshape(self.outer, self.classes, self.inner)
        xp.copyto(gx[0], saved["prob"])
        _, safe, outer_index, inner_index = self.gather(xp, gx3, labels)
        gx3[outer_index, safe, inner_index] -= 1
        if self.ignore_label is not None:
            ignored = (labels == self.ignore_label)[:, None, :]
            xp.multiply(gx3, ~ignored, out=gx3)
        gx[0] *= gy[0] / self._normalizer(xp, labels)


@register
class Accuracy(_LabelLayer):
    """Fraction of predictions with fewer than top_k other classes scoring at least the true
    class's score, as Caffe counts (no backward)."""
    type = "Accuracy"
    param_field = "accuracy_param"
    num_tops = (1, 2)      # a second top: Caffe's per-class accuracies (classes,)

    def setup(self, bottom_shapes):
        self.setup_labels(bottom_shapes, self.p.get("axis", 1))
        self.top_k = self.p.get("top_k", 1)
        if not 1 <= self.top_k <= self.classes:
            self.fail(f"top_k must be in [1, {self.classes}]")
        return [()] if len(self.spec.tops) == 1 else [(), (self.classes,)]

    @property
    def has_backward(self):
        return False

    def propagates_down(self, index):
        return False

    def workspace(self, phase, gx_needed=None):
        return {"above": TensorDecl(self.bottom_shapes[0], np.bool_)} if phase == "forward" else {}

    def forward(self, xp, x, y, p, saved, ws):
        scores3 = x[0].reshape(self.outer, self.classes, self.inner)
        labels = self.labels(xp, x[1])
        true_score, _, _, _ = self.gather(xp, scores3, labels)
        above = ws["above"].reshape(scores3.shape)
        # Caffe counts every class scoring >= the true class, the true class included (so
        # ties count against the prediction, and a NaN true score, >= nothing, is a hit)
        xp.greater_equal(scores3, true_score[:, None, :], out=above)
        correct = above.sum(axis=1) <= self.top_k
        if self.ignore_label is None:
            y[0][...] = correct.mean()
        else:
            valid = labels != self.ignore_label
            y[0][...] = (correct & valid).sum() / max(1, int(valid.sum()))
        if len(y) == 2:
            self._per_class(xp, labels, correct, y[1])

    def _per_class(self, xp, labels, correct, out):
        """out[c] <- the hit rate of the samples labelled c (0 where there are none), ignored
        labels left out, as Caffe's second top."""
        safe = labels.reshape(-1)
        counted = xp.ones(safe.shape, dtype=out.dtype)
        if self.ignore_label is not None:
            valid = safe != self.ignore_label
            safe = xp.where(valid, safe, 0)
            counted = valid.astype(out.dtype)
        totals = xp.bincount(safe, weights=counted, minlength=self.classes)
        hits = xp.bincount(safe, weights=counted * correct.reshape(-1), minlength=self.classes)
        xp.divide(hits, xp.maximum(totals, 1), out=out, casting="unsafe")
