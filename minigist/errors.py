"""Errors a user can cause and fix: each prints as one line naming the file, line or flag."""


class MinigistError(Exception):
    """Base for errors caused by bad input; the CLI prints them in one line and exits with 2."""


class ModelFileError(MinigistError):
    """A problem in a model file, located by path and line."""

    def __init__(self, path, line, message):
        self.path = path
        self.line = line
        self.message = message
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {message}")


class LayerSetupError(MinigistError):
    """Raised by a layer while checking its parameters or shapes; the graph adds file and line."""


class MemoryBudgetError(MinigistError):
    """A memory plan or a pool request does not fit the budget."""


class MachineMemoryError(MemoryBudgetError):
    """A plan needs more memory than this machine has available; the message names the flags
    that change it, so train.py puts no flag of its own before it."""
