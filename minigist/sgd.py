"""Stochastic gradient descent: the solver's settings (`SGD`) and the update step bound to a
parameter's arrays (`bind_update`)."""


class SGD:
    """Caffe's SGD with momentum: g += decay * decay_mult * w; v = momentum * v +
    lr * lr_mult * g; w -= v. The learning rate may change between steps."""

    def __init__(self, lr=0.01, momentum=0.9, weight_decay=0.0):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)


def bind_update(xp, solver, weight, grad, momentum, scratch, lr_mult, decay_mult):
    """A no-argument callable that applies one SGD step of `solver` to `weight`, given its
    gradient (which it overwrites: decay is added in) and its momentum, through `scratch`."""
    # the scratch holds one chunk: a parameter-sized temporary would cost as much as the
    # parameter itself (453 MB for OverFeat's fc6)
    chunk = scratch.size
    pieces = [(w, g, v, scratch[:w.size]) for w, g, v in (
        (weight.reshape(-1)[i:i + chunk], grad.reshape(-1)[i:i + chunk], momentum.reshape(-1)[i:i + chunk])
        for i in range(0, weight.size, chunk))]

    def update():
        decay = solver.weight_decay * decay_mult
        rate = solver.lr * lr_mult
        for w, g, v, tmp in pieces:
            if decay:
                xp.multiply(w, decay, out=tmp)
                xp.add(g, tmp, out=g)
            xp.multiply(g, rate, out=tmp)
            xp.multiply(v, solver.momentum, out=v)
            xp.add(v, tmp, out=v)
            xp.subtract(w, v, out=w)
    return update
