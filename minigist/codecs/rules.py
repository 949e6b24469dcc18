"""How Gist picks a codec for one stashed tensor: one ordered list of rules.

A rule is a function of a Site (one stashed tensor: its buffer, its producer, the layers of
the backward steps that read it, the layers that consume it in the forward pass, the
GistConfig) that returns a Choice, or None to let the next rule decide. The user's rules
(`register_codec(producer_type, consumer_type, factory)`) come first, then the built-in ones,
registered below through the same `register_rule`, in this order:

1. a MaxPool's saved argmax: 4-bit codes (lossless);
2. a saved boolean mask (Dropout's): 1 bit per element (lossless);
3. the top of a layer whose backward needs only its sign (Layer.mask_backward: ReLU), read by
   that backward alone: fused into the codes of the max-pools it feeds, or a 1-bit mask
   (Binarize, lossless);
4. a sparse float32 map (from a Layer.sparse_output layer through Layer.keeps_zeros ones):
   SSDC, sized by its measured density (lossless);
5. any float32 feature map of the batch: DPR in the configured format (lossy).
"""
from dataclasses import dataclass, field

import numpy as np

_USER_RULES = []
_BUILTIN_RULES = []
_USER_PAIRS = {}


@dataclass
class Choice:
    """What one rule decided for a stashed tensor."""
    codec: object                     # None: kept as it is (or dropped, with `dropped`)
    inputs: tuple = ()                # other buffers the encode step reads besides the tensor
    dropped: bool = False             # nothing stored: other tensors' codes carry it
    reader_form: str = None           # how its backward readers read it: "mask" or "identity"
    also: dict = field(default_factory=dict)   # other stashed buffers decided with it


@dataclass
class Site:
    """One stashed tensor, as the rules see it."""
    buffer: object                    # the Buffer (kind, tensor, part, shape, dtype)
    producer: object                  # the layer that writes it
    readers: list                     # layers of the backward-pass steps that read it (backward
                                      # steps; a recomputation's replays, which need its values)
    consumers: list                   # layers that read it in the forward pass (a blob's)
    config: object                    # the GistConfig
    sparse: bool = False              # a sparse-prone map (rule 4)
    dpr_applies: bool = False         # a float32 feature map of the batch, DPR-sized (rule 5)
    ssdc: object = None               # the SSDC codec sized for it, when it beats the dense form
    saved_of: object = None           # (layer, part) -> the name of that layer's saved buffer, or None
    top_of: object = None             # layer -> the name of its first top's buffer


def register_rule(rule, builtin=False):
    """Add `rule(site) -> Choice | None`; a user's rules are asked before the built-in ones."""
    (_BUILTIN_RULES if builtin else _USER_RULES).append(rule)


def register_codec(producer_type, consumer_type, factory):
    """Use `factory(shape, dtype) -> Codec` for maps that a `producer_type` layer produces and a
    `consumer_type` layer keeps for its backward pass."""
    key = (producer_type, consumer_type)
    if key in _USER_PAIRS:
        raise ValueError(f"a codec is already registered for {producer_type} -> {consumer_type}")

    def rule(site):
        if site.producer.type != producer_type:
            return None
        if any(r.type == consumer_type for r in site.readers if r.name != site.producer.name):
            return Choice(factory(site.buffer.shape, site.buffer.dtype))
        return None
    _USER_PAIRS[key] = rule
    _USER_RULES.append(rule)


def unregister_codec(producer_type, consumer_type):
    _USER_RULES.remove(_USER_PAIRS.pop((producer_type, consumer_type)))


def choose(site):
    """The first rule's Choice for `site` (Choice(None): kept as it is)."""
    for rule in _USER_RULES + _BUILTIN_RULES:
        choice = rule(site)
        if choice is not None:
            return choice
    return Choice(None)


# ---- the built-in rules --------------------------------------------------------------------
PACKED_MAX_CODES = 16       # 4-bit codes: window positions 0..15


def argmax_codes(site):
    buffer, positions = site.buffer, site.producer.argmax_positions()
    if (site.config.lossless and buffer.kind == "saved" and buffer.part == "argmax"
            and positions is not None and positions <= PACKED_MAX_CODES):
        from .bits import PackedCodes
        return Choice(PackedCodes(4))
    return None


def boolean_mask(site):
    if site.config.lossless and site.buffer.kind == "saved" and site.buffer.dtype == np.bool_:
        from .bits import BitMask
        return Choice(BitMask())
    return None


def binarize(site):
    """Gist's Binarize: the fused ReLU->MaxPool code where every consumer is a max-pool whose
    codes have room for one more value, else a 1-bit mask."""
    from .bits import BitMask, PackedCodes
    from .fused import FusedReluPool
    layer, config = site.producer, site.config
    if not (config.lossless and site.buffer.kind == "blob" and layer.mask_backward
            and all(r.name == layer.name for r in site.readers)):
        return None
    consumers = site.consumers
    positions = [c.argmax_positions() for c in consumers]
    # the fused code drops the gradient where the pool output is <= 0: right for max(x, 0),
    # not for a leaky ReLU (which passes slope * gy there)
    if (config.binarize == "fused" and layer.gradient_only_where_positive and consumers
            and all(p is not None and p + 1 <= PACKED_MAX_CODES for p in positions)
            and all(site.saved_of(c, "argmax") is not None and c.name not in config.overrides
                    and f"{c.name}.argmax" not in config.overrides for c in consumers)):
        also = {site.saved_of(c, "argmax"): Choice(FusedReluPool(PackedCodes(4), p), inputs=(site.top_of(c),))
                for c, p in zip(consumers, positions)}
        return Choice(None, dropped=True, reader_form="identity", also=also)
    return Choice(BitMask(), reader_form="mask")


def sparse_map(site):
    if (site.config.lossless and site.buffer.kind == "blob" and site.buffer.dtype == np.float32
            and site.sparse and site.ssdc is not None):
        return Choice(site.ssdc)
    return None


def reduced_precision(site):
    if site.dpr_applies:
        from .dpr import DPR
        return Choice(DPR(site.config.dpr))
    return None


for _rule in (argmax_codes, boolean_mask, binarize, sparse_map, reduced_precision):
    register_rule(_rule, builtin=True)
