"""Layer families, one module each; importing this package registers every layer type."""
from .base import LAYER_TYPES, Layer, ParamDecl, TensorDecl, register
from . import data, activation, inner_product, conv, pooling, normalization, structural, loss

__all__ = ["LAYER_TYPES", "Layer", "ParamDecl", "TensorDecl", "register"]
