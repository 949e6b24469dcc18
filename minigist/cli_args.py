"""The command line's value parsers (argparse `type=` functions), its one-line error parser,
and the checks that hold a checkpoint's recorded configuration to the same flags' rules."""
import argparse
import decimal
import math
import numbers
import re


# counts and sizes are bounded as Caffe's schema bounds its uint32 fields (batch_size,
# num_output, max_iter's range): past it a plan's arithmetic leaves what numpy's int64 shapes
# hold, and factoring a batch for oneDNN's chunks would take minutes
UINT32_MAX = 2**32 - 1
SEED_MAX = 2**64 - 1       # numpy's and torch's seeds take 64 bits


def _integer_in(text, least, most, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    if value > most:
        raise argparse.ArgumentTypeError(f"expected a {what} integer of at most {most:,}, got {text!r}")
    return value


def positive_int(text):
    return _integer_in(text, 1, UINT32_MAX, "positive")


def non_negative_int(text):
    return _integer_in(text, 0, UINT32_MAX, "non-negative")


def seed_int(text):
    return _integer_in(text, 0, SEED_MAX, "non-negative")


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def fraction_inclusive(text):
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def fraction(text):
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def byte_size(text):
    """'2GiB', '512MB', '1e9' -> bytes (a positive, finite number of them)."""
    match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MB or 1e9, got {text!r}")
    # decimal arithmetic: '1e30' is 10**30 bytes, not the float nearest it
    value = decimal.Decimal(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(float(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is too large to be a size")
    if value < 1:
        raise argparse.ArgumentTypeError(f"a memory budget must be positive (at least 1 byte), got {text!r}")
    if not match.group(2) and value != int(value):
        raise argparse.ArgumentTypeError(f"a size without a unit counts bytes, a whole number of them; got {text!r}")
    return int(value)     # with a unit, what rounds to a fraction of a byte is rounded down


def budget_bytes(budget):
    """A memory budget in bytes, as the library takes it: None, a positive whole number of
    bytes, or a size string such as "40MiB" (read as --memory-budget reads it)."""
    from .errors import MinigistError
    if budget is None:
        return None
    if isinstance(budget, str):
        try:
            return byte_size(budget)
        except argparse.ArgumentTypeError as exc:
            raise MinigistError(f"budget: {exc}") from None
    whole = isinstance(budget, numbers.Integral) or (isinstance(budget, float) and budget.is_integer())
    if isinstance(budget, bool) or not whole or budget < 1:
        raise MinigistError(f"budget: a positive whole number of bytes or a size such as '40MiB', not {budget!r}")
    return int(budget)


def join_negative_sizes(argv):
    """`--memory-budget -5GB` as `--memory-budget=-5GB`: argparse would take -5GB for a flag
    and say the budget is missing, where the user meant a (wrong) negative size."""
    out = list(argv)
    for index in range(len(out) - 1):
        if out[index] == "--memory-budget" and re.match(r"-[0-9.]", out[index + 1]):
            out[index:index + 2] = [f"--memory-budget={out[index + 1]}", None]
    return [arg for arg in out if arg is not None]


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit status 2, like every other bad-input error."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


_UNSET = object()


def explicit_flags(make_parser, argv):
    """The destinations the command line sets (as opposed to defaults), found by parsing
    `argv` again with a fresh parser from `make_parser` whose defaults are all unset."""
    probe = make_parser()
    for action in probe._actions:
        if action.dest != "help":
            action.default = _UNSET
    values = vars(probe.parse_args(argv))
    return {dest for dest, value in values.items() if value is not _UNSET}


# settings a checkpoint may record as null: "not given, the model file's or the data's"
_MAY_BE_NULL = ("epochs", "iters", "input_size", "batch_size", "crop_pad", "memory_budget")


def config_checker(parser, keys):
    """A check of a checkpoint's configuration (minigist.checkpoint.check_meta's `check_config`):
    every value of `keys` must be one its flag accepts; raises ValueError naming the first not."""
    actions = {action.dest: action for action in parser._actions}

    def check(config):
        for key in keys:
            if key not in config:       # one check_meta allows to be absent (an earlier run's checkpoint)
                continue
            value, action = config[key], actions[key]
            if value is None and key in _MAY_BE_NULL:
                continue
            if action.choices is not None and value not in action.choices:
                raise ValueError(f"the configuration's {key} is {value!r}, not one of {', '.join(action.choices)}")
            if action.type is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise ValueError(f"the configuration's {key} is {value!r}")
                try:
                    action.type(str(value))
                except (argparse.ArgumentTypeError, ValueError) as exc:
                    raise ValueError(f"the configuration's {key}: {exc}") from None
            elif isinstance(action, argparse._StoreTrueAction):
                if not isinstance(value, bool):
                    raise ValueError(f"the configuration's {key} is {value!r}, not true or false")
            elif action.choices is None and not isinstance(value, str):
                raise ValueError(f"the configuration's {key} is {value!r}, not a string")
    return check
