"""The in-place pass: which steps may write their output over their input (a forward step, a
recomputation's replay of one, x to y; a backward step, gy to gx).

Reads: a program with liveness (after the Gist pass, whose encode steps move last uses), and
each layer's `inplace_safe` fact.
Provides: `program.inplace`, the (input buffer, output buffer) name pairs whose storage the
static and dynamic plans merge: the layer allows it, the input is read by no later step and
by no other role of the same step, the sizes match, and the input is neither the net's input
nor a persistent buffer. The "none" plan ignores them (every buffer its own bytes).
"""
from ..program import INPUT, names_in


def mark_inplace(program):
    """`program` with its `inplace` pairs filled in (the same program: an annotation)."""
    program.inplace = tuple(inplace_pairs(program))
    return program


def inplace_pairs(program):
    """(input buffer, output buffer) pairs where a step may write its output over its input."""
    buffers = program.buffers
    pairs = []
    for index, step in enumerate(program.steps):
        if step.kind not in ("forward", "recompute", "backward") or not step.layer.inplace_safe(0, 0):
            continue
        source_role, target_role = ("gy", "gx") if step.kind == "backward" else ("x", "y")
        sources, targets = step.args[source_role], step.args[target_role]
        if not sources or not targets or sources[0] is None or targets[0] is None:
            continue
        source, target = buffers[sources[0]], buffers[targets[0]]
        other_reads = [name for role in ("x", "y", "gy", "saved", "p") if role in step.args
                       for name in names_in(step.args[role])]
        if (source.last_use == index and target.first_use == index and source.nbytes == target.nbytes
                and source.category != INPUT and not source.persistent
                and other_reads.count(source.name) == 1):
            pairs.append((source.name, target.name))
    return pairs
