"""Memory: where every buffer of a program lives.

The planners here work on integers only (sizes and step indices), never on arrays.
"""
ALIGNMENT = 256


def align(nbytes, alignment=ALIGNMENT):
    return (int(nbytes) + alignment - 1) // alignment * alignment


def plan_none(sizes):
    """Every buffer its own space, no sharing: offsets for `sizes` (name -> nbytes) and the
    total. This is the reference layout of a framework without a planner."""
    offsets, total = {}, 0
    for name, nbytes in sizes.items():
        offsets[name] = total
        total += align(nbytes)
    return offsets, total
