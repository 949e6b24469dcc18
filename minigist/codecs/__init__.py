"""Gist's codecs, and how the schedule builder picks one per stashed tensor.

Encodings by name (the names the footprint report uses):

| name          | codec                      | lossless | stores                                        |
|---------------|----------------------------|----------|-----------------------------------------------|
| fp32          | none                       | yes      | the tensor itself                             |
| mask-1bit     | BitMask                    | yes      | ReLU output > 0 (or a Dropout mask), 1 bit    |
| index-4bit    | PackedCodes(4)             | yes      | MaxPool argmax, 4 bits per pool output        |
| relu-pool-4bit| FusedReluPool              | yes      | one code per pool output: argmax or "max <= 0"|
| ssdc          | SSDC (CSR-256 or bitmap)   | yes*     | the non-zeros of a sparse map                 |
| fp16 / fp10 / fp8-e4m3 / fp8-e5m2 | DPR    | no       | the map in reduced precision                  |

(*) SSDC is lossless with fp32 values; under `--gist all` its values use the DPR format.
An fp16 stash that every backward reader takes as float16 is a HalfStash: DPR fp16 codes that
those readers read as they are, without a decoded copy (still named fp16).

Which codec a stashed tensor gets is decided by one ordered list of rules (codecs/rules.py):
a user's codec for a (producer type, consumer type) pair, registered with `register_codec`,
is asked before the built-in rules, which are registered the same way. Registering a pair
twice is an error.
"""
from .base import Codec
from .rules import register_codec, register_rule, unregister_codec

GIST_MODES = ("none", "lossless", "lossy", "all")
DPR_FORMATS = ("fp16", "fp10", "fp8-e4m3", "fp8-e5m2")
BINARIZE_FORMS = ("fused", "paper")

class GistConfig:
    """What the schedule builder may do.

    mode: none | lossless | lossy | all; dpr: the reduced-precision format; binarize:
    'fused' (one code per pool output, the default) or 'paper' (1-bit mask + 4-bit argmax);
    overrides: {layer name or stashed tensor name: encoding name ('fp32' keeps a map as it is)};
    ssdc_density: {tensor name: the largest fraction of non-zeros to plan for}, measured by
    calibration; tensors without an entry are planned dense (no SSDC).
    """

    def __init__(self, mode="none", dpr="fp16", binarize="fused", overrides=None, ssdc_density=None):
        if mode not in GIST_MODES:
            raise ValueError(f"--gist: expected one of {', '.join(GIST_MODES)}, got {mode!r}")
        if dpr not in DPR_FORMATS:
            raise ValueError(f"--dpr: expected one of {', '.join(DPR_FORMATS)}, got {dpr!r}")
        if binarize not in BINARIZE_FORMS:
            raise ValueError(f"binarize: expected one of {', '.join(BINARIZE_FORMS)}, got {binarize!r}")
        self.mode = mode
        self.dpr = dpr
        self.binarize = binarize
        self.overrides = dict(overrides or {})
        self.ssdc_density = dict(ssdc_density or {})

    @property
    def lossless(self):
        return self.mode in ("lossless", "all")

    @property
    def lossy(self):
        return self.mode in ("lossy", "all")

    @property
    def exact(self):
        """Whether training loses no precision: no DPR by the mode or by an override (an fp16
        override, or SSDC with fp16 values, under a lossless mode: what minigist.optimize
        chooses under --gist all)."""
        return not self.lossy and not any(name.removeprefix("ssdc-") in DPR_FORMATS
                                          for name in self.overrides.values())

    def __repr__(self):
        return f"GistConfig(mode={self.mode!r}, dpr={self.dpr!r}, binarize={self.binarize!r})"


__all__ = ["Codec", "GistConfig", "register_codec", "register_rule", "unregister_codec", "GIST_MODES",
           "DPR_FORMATS"]
