"""minigist: a small deep-learning framework that measures, byte for byte, where training
memory goes, with Gist's stash encodings (Jain et al., ISCA 2018) built in."""
from .backend import get_xp, gpu_available, to_numpy
from .errors import LayerSetupError, MemoryBudgetError, MinigistError, ModelFileError
from .graph import build_graph
from .net import Net, default_threads, summary
from .pipeline import CONV_CHOICES, CONV_ENGINES, Compiled, Options, compile, plan_footprint
from .sgd import SGD
from .optimize import optimize
from .passes.backward import build_program

__version__ = "0.1.0"
__all__ = ["Net", "Options", "optimize", "Compiled", "compile", "plan_footprint", "CONV_ENGINES", "CONV_CHOICES", "default_threads",
           "SGD", "build_graph", "build_program",
           "summary", "get_xp", "gpu_available", "to_numpy", "MinigistError", "ModelFileError", "LayerSetupError", "MemoryBudgetError"]
