"""The layer contract.

A layer is built from its model-file entry, checks its parameters and infers its output shapes
in `setup` before any array exists, and then declares everything it needs as shapes:

- `params`: its learned (and state) tensors, each a `ParamDecl` with filler and multipliers;
- `keeps_bottoms` / `keeps_tops`: which inputs / outputs its backward reads (the "stash");
- `saved`: private tensors that forward writes and backward reads (MaxPool's argmax,
  Dropout's mask); they are part of the stash too;
- `workspace(phase)`: scratch tensors for one forward or backward call (im2col columns);
- what re-running its forward involves (`recomputable`, `forward_updates_state`,
  `forward_draws_random`, `replay_forward`): what the recomputation pass relies on.

`forward` and `backward` receive every array from the executor (views into planned memory)
and write their results into the arrays they are handed, through `xp` (numpy or cupy).
A layer keeps no arrays on itself, so a later pass can move, share or encode any of them.
"""
from dataclasses import dataclass, field

from ..errors import LayerSetupError

LAYER_TYPES = {}


def register(cls):
    """Class decorator: make a layer type available to model files under `cls.type`."""
    if cls.type in LAYER_TYPES:
        raise ValueError(f"layer type {cls.type!r} registered twice")
    LAYER_TYPES[cls.type] = cls
    return cls


@dataclass
class ParamDecl:
    """One parameter tensor of a layer."""
    name: str            # "weight", "bias", "mean", ...
    shape: tuple
    filler: dict         # {"type": "xavier", ...}: the FillerParameter fields
    lr_mult: float = 1.0
    decay_mult: float = 1.0
    learnable: bool = True   # False for state such as BatchNorm's running statistics
    initial: object = None   # the model file's starting value (an ONNX initializer), array-like of
                             # `shape`; None: the filler starts it

    @property
    def trained(self):
        return self.learnable and self.lr_mult != 0.0


@dataclass
class TensorDecl:
    shape: tuple
    dtype: object = None     # None: the net's float dtype


@dataclass
class LayerSpec:
    """What the model file says about one layer, with where it says it."""
    name: str
    type: str
    bottoms: list
    tops: list
    msg: object              # prototxt.Msg of the layer
    path: str
    line: int
    phase: str = "TRAIN"
    param_specs: list = field(default_factory=list)   # [(lr_mult, decay_mult)] from the file
    loss_weights: list = field(default_factory=list)
    propagate_down: list = field(default_factory=list)
    initial: dict = field(default_factory=dict)       # {param name: starting value} from the file
    origin: str = ""         # where a generated layer comes from ("node 'conv1' (Conv)"), for errors


class Layer:
    type = None
    param_field = None       # e.g. "convolution_param"
    num_bottoms = (1, 1)     # (min, max); max None = unbounded
    num_tops = (1, 1)
    is_loss = False
    is_data = False
    caffe_type = True        # a type Caffe's model files name (False: an ONNX operator's layer)

    def __init__(self, spec, dtype, engine=None):
        self.spec = spec
        self.name = spec.name
        self.dtype = dtype
        self.engine = engine     # the compute engine the graph is built for, where a layer has several
        self.params = []
        self.saved = {}
        self.keeps_bottoms = ()
        self.keeps_tops = ()
        self.rng = None      # set by the executor for layers that draw random numbers
        self.bottom_shapes = None
        self.top_shapes = None

    # ---- model-file helpers -------------------------------------------------------------
    @property
    def p(self):
        """This layer's *_param message (an empty one if the file gives none)."""
        msg = self.spec.msg.get(self.param_field) if self.param_field else None
        if msg is None:
            from ..prototxt import Msg
            msg = Msg(self.param_field or "", self.spec.line)
        return msg

    def fail(self, message):
        raise LayerSetupError(f"layer '{self.name}' ({self.type}): {message}")

    def add_param(self, name, shape, filler, learnable=True):
        index = len(self.params)
        lr_mult, decay_mult = 1.0, 1.0
        if index < len(self.spec.param_specs):
            lr_mult, decay_mult = self.spec.param_specs[index]
        if not learnable:
            lr_mult, decay_mult = 0.0, 0.0
        shape = tuple(int(d) for d in shape)
        initial = self.spec.initial.get(name)
        if initial is not None and tuple(initial.shape) != shape:
            self.fail(f"the file's {name} has shape {tuple(initial.shape)}, the layer needs {shape}")
        self.params.append(ParamDecl(name, shape, filler or {}, lr_mult, decay_mult, learnable, initial))

    # ---- the contract -------------------------------------------------------------------
    def setup(self, bottom_shapes):
        """Check parameters, declare params/saved/keeps; return the top shapes."""
        raise NotImplementedError

    def workspace(self, phase, gx_needed=None):
        """Scratch tensors for one call: {name: TensorDecl}; phase is 'forward' or 'backward'.
        gx_needed (backward): which input gradients the backward step writes, a bool per
        bottom (None: every one a gradient can flow to)."""
        return {}

    def propagates_down(self, index):
        """Whether a gradient can flow to bottom `index` (False for labels)."""
        return True

    @property
    def has_backward(self):
        return True

    stream_role = "x"   # which stash stream_chunk() is about: the first bottom, or "y" the top

    # facts about values and gradients, which passes may rely on (Gist's codec rules):
    sparse_output = False   # its top is zero wherever its input is not positive (ReLU)
    keeps_zeros = False     # its top is as sparse as its bottoms: zeros stay zeros (Concat, Split, ...)
    elementwise = False     # forward and backward compute each sample alone, and every tensor and
                            # workspace has the batch first: may run one batch slice at a time (a
                            # workspace of fewer rows than the batch is handed its leading rows)
    mask_backward = False   # backward_from_mask(xp, mask, gy, gx, ws) gives the backward from
                            # (y[0] > 0) alone, without y
    gradient_only_where_positive = False    # gx = gy where y[0] > 0, and 0 elsewhere
    microbatchable = False  # forward and backward compute each sample alone, the same bits for a
                            # micro-batch as for those samples in the whole batch (set up for
                            # it: passes/microbatch.py), and any parameter gradient, with
                            # backward(..., accumulate=True), is added into in the order the
                            # whole batch's backward sums the samples

    def argmax_positions(self):
        """The count of window positions K when its saved "argmax" holds, per output, the
        position 0..K-1 of the input that backward sends the gradient to; else None."""
        return None

    def stream_chunk(self):
        """Samples of its first bottom (top, with stream_role "y") the backward reads at a
        time, as x[0][n0:n0 + b] slices of at most b samples and nothing else (so a stash
        encoded per sample can be decoded one slice at a time); 0: it reads x[0] whole."""
        return 0

    def forward_stream_chunk(self):
        """Samples of its first bottom the forward reads at a time, as x[0][n0:n0 + b] slices
        of at most b samples and nothing else (so that a replay of it can read a stash encoded
        per sample one decoded slice at a time); 0: it reads x[0] whole."""
        return 0

    def reads_half(self):
        """Whether the backward takes its stream_role's first tensor (x[0], or y[0]) as a
        float16 array of the same shape instead of the float32 one, reading each element as
        its exact float32 value: Gist then hands it its fp16 stash as it is, without a
        decoded float32 copy."""
        return False

    def emits_top_slices(self):
        """Whether its forward ends with a per-channel scale of its first top (y *= scale[c],
        c on axis 1) and forward(..., emit=f) hands that last step over: for each batch slice
        n0:n1 (in order, covering the batch) it calls f(n0, n1, scale, scratch) instead, which
        must do the scaling, `scratch` a float32 array of the slice's size free until f
        returns: a pass can then encode the top in the same pass (BatchNorm's x_hat)."""
        return False

    def inplace_safe(self, bottom_index, top_index):
        """Whether top `top_index` may overwrite bottom `bottom_index` in forward and backward."""
        return False

    # facts about re-running the forward, which recomputation relies on (passes/recompute.py):
    forward_updates_state = False   # forward writes state params (BatchNorm's running sums)
    forward_draws_random = False    # forward draws random numbers, kept in `saved` (Dropout's mask)

    @property
    def recomputable(self):
        """Whether `replay_forward` may rebuild its tops in the backward pass: not a data
        layer's (the executor writes them) nor a loss layer's."""
        return not (self.is_data or self.is_loss)

    def replay_workspace(self):
        """The scratch tensors of one `replay_forward` call."""
        return self.workspace("forward")

    def replay_forward(self, xp, x, y, p, saved, ws):
        """The forward once more, writing the same tops bit for bit: no state written
        (forward_updates_state) and the random numbers the forward kept in `saved` reused, not
        drawn again (forward_draws_random: `saved` is then read only); for other layers `saved`
        is scratch the replay may write. A layer with either fact overrides this."""
        if self.forward_updates_state or self.forward_draws_random:
            raise NotImplementedError(f"{self.type} declares forward effects but no replay_forward")
        self.forward(xp, x, y, p, saved, ws)

    def forward(self, xp, x, y, p, saved, ws):
        raise NotImplementedError

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        """Write input gradients into gx[i] (None where not needed) and parameter gradients
        into gp[j] (None for frozen parameters). x and y hold only the kept tensors."""
        raise NotImplementedError

    # --update blocked's fact (passes/backward.py): the gradient of the first parameter can be
    # made a block of its rows at a time by weight_grad_rows, from the kept x and gy alone
    weight_grad_in_rows = False

    def weight_grad_rows(self, xp, x, gy, gw, first, end):
        """Write rows first:end of the first parameter's gradient into gw (end - first rows):
        the same dot products as those rows of the whole gradient `backward` writes (a BLAS
        may round a block's edge rows apart: passes/backward.py, ROW_ALIGN)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<{self.type} {self.name}>"


def paired(x, y, view):
    """(view(x), view(y)) for a reshape or slice `view`: one object when x is y (an in-place
    step), since CuPy copies a ufunc input that overlaps the output without being the same
    object (a temporary outside the arena); numpy reads either way alike."""
    vx = view(x)
    return vx, (vx if y is x else view(y))


def expect_int_list(layer, values, what, count):
    """Expand Caffe's repeated-or-single field (kernel_size: 3 -> [3, 3])."""
    values = list(values)
    if len(values) == 1:
        return values * count
    if len(values) != count:
        layer.fail(f"{what} needs 1 or {count} values, got {len(values)}")
    return values


def filler_of(msg, default_type="constant"):
    """A FillerParameter message as a plain dict with Caffe's defaults."""
    filler = {"type": default_type, "value": 0.0, "min": 0.0, "max": 1.0, "mean": 0.0,
              "std": 1.0, "variance_norm": "FAN_IN"}
    if msg is not None:
        for name, value, _ in msg.fields:
            filler[name] = value
    return filler
