"""How much memory this machine can give, so that a plan too big for it fails in one line
before anything is allocated (instead of numpy's MemoryError, or the kernel's OOM killer)."""
import os

from ..errors import MachineMemoryError

# set to a byte count to make minigist plan for a smaller machine (tests; shared hosts)
ENV_OVERRIDE = "MINIGIST_AVAILABLE_MEMORY"


def available_bytes():
    """(bytes, where the figure comes from), or (None, reason) where it cannot be told.
    Linux: /proc/meminfo's MemAvailable (what can be allocated without swapping); otherwise
    the free physical pages that os.sysconf reports."""
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        try:
            return int(override), ENV_OVERRIDE
        except ValueError:
            pass
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical memory"
    except (AttributeError, ValueError, OSError):
        return None, "unknown"


def _size(nbytes):
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes} B"


def check_fits(nbytes, what, at_least=False):
    """Raise MachineMemoryError if `nbytes` (what: e.g. "the static plan of vgg16 at batch 64";
    `at_least`: a lower bound of what it needs) is more than this machine has available."""
    free, source = available_bytes()
    if free is not None and nbytes > free:
        raise MachineMemoryError(f"{what} needs {'at least ' if at_least else ''}{nbytes:,} bytes ({_size(nbytes)}); this machine has "
                                f"{free:,} bytes ({_size(free)}) available ({source}): use a smaller "
                                f"--batch-size or --input-size, or a smaller model")
