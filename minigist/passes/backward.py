"""The backward pass: a graph -> the program of one training iteration (or one inference pass).

Reads: the graph (its layers' declared facts: keeps_bottoms/keeps_tops, saved, params,
workspace, propagates_down; the file's propagate_down, force_backward, loss weights).
Provides: a Program of forward steps, loss seeds, backward steps (with accumulation where a
blob feeds several layers), zero fills for tops nobody differentiates, and SGD update steps,
every buffer typed (kind, tensor, part) with its shape, dtype and category, and liveness
computed. Nothing is encoded and nothing shares storage yet: the Gist and in-place passes
rewrite or annotate this program before it is planned.
"""
import numpy as np

from ..program import (GRADIENT, INPUT, OPTIMIZER_STATE, STASH, FEATURE, UPDATE_CHUNK, WEIGHT_GRADS, WEIGHTS,
                       WORKSPACE, Buffer, Program, Step, param_buffer_names)


def _gradient_flags(graph):
    """Which blobs need a gradient: they reach a loss and depend on a trained parameter, or
    (force_backward, as Caffe) a layer that reaches a loss can send one to them."""
    reaches_loss = {name: name in graph.loss_weights for name in graph.blobs}
    for node in reversed(graph.nodes):
        if node.layer.has_backward and any(reaches_loss[t] for t in node.tops):
            for bottom in node.bottoms:
                reaches_loss[bottom] = True
    if graph.force_backward:
        forced = {name: name in graph.loss_weights for name in graph.blobs}
        for node in graph.nodes:
            if node.layer.has_backward and any(reaches_loss[t] for t in node.tops):
                for index, bottom in enumerate(node.bottoms):
                    forced[bottom] = forced[bottom] or _propagates(graph, node.layer, index)
        return forced
    trained_upstream = {}
    for node in graph.nodes:
        layer = node.layer
        flows = layer.has_backward and (
            any(p.trained for p in layer.params) or
            any(trained_upstream[b] and _propagates(graph, layer, i) for i, b in enumerate(node.bottoms)))
        for top in node.tops:
            trained_upstream[top] = flows
    return {name: trained_upstream[name] and reaches_loss[name] for name in graph.blobs}


def _propagates(graph, layer, index):
    """Whether the backward of `layer` writes the gradient of its bottom `index`: where it can,
    unless the file's propagate_down says no (force_backward overrides that, as in Caffe)."""
    if not layer.propagates_down(index):
        return False
    flags = layer.spec.propagate_down
    return graph.force_backward or index >= len(flags) or flags[index]


def _add_workspace(buffers, layer, phase, gx_needed=None):
    names = {}
    for ws_name, decl in layer.workspace(phase, gx_needed).items():
        tensor = f"{layer.name}.{phase}.{ws_name}"
        name = f"ws:{tensor}"
        buffers[name] = Buffer(name, tuple(decl.shape), np.dtype(decl.dtype or layer.dtype),
                               WORKSPACE, layer.name, kind="ws", tensor=tensor, part=ws_name)
        names[ws_name] = name
    return names


def build_program(graph, train=True, fused_update=False, block_bytes=None):
    """The program of one training iteration (train=True) or of one inference pass.

    The SGD update of a parameter runs after the whole backward pass (fused_update=False, as
    Caffe does: every weight gradient stays readable until the next iteration), or right after
    the backward step of its layer (fused_update=True): nothing reads a layer's weights or its
    weight gradient after that step (shared weights are refused), so the update gives the same
    weights bit for bit, and each weight gradient lives only from its backward step to its
    update, where the planner can reuse its bytes.

    With the fused update and `block_bytes` (--update blocked), a weight gradient of more bytes
    whose layer can make it a block of rows at a time (Layer.weight_grad_in_rows: InnerProduct)
    is never whole: the layer's backward step writes its other gradients (the input's first,
    while the weights are still unchanged), then for each block of rows of about `block_bytes`
    a backward step (args "rows": (first, end)) writes those rows of the gradient into one block
    buffer and an update step (the same "rows") applies them to those rows of the weights and
    momentum; the block buffer replaces the whole gradient in the plan. Each row is the same dot
    products as in the whole GEMM, but a BLAS may round a block's edge rows apart from the same
    rows inside a larger product (its kernels tile the rows; threads split them), so the weights
    are those of the fused update to float32 rounding, and bit for bit where the tiles meet:
    blocks start at multiples of ROW_ALIGN rows, which one OpenBLAS thread tiles alike."""
    buffers, steps = {}, []

    def add(kind, tensor, shape, dtype, category, layer_name, part=""):
        """A buffer of `kind` for `tensor` (its part), named as reports show it."""
        name = f"{kind}:{tensor}" + (f"#{part}" if kind == "grad" and part else "")
        buffers[name] = Buffer(name, tuple(shape), np.dtype(dtype), category, layer_name,
                               kind=kind, tensor=tensor, part=part)
        return name

    needs_grad = _gradient_flags(graph) if train else {name: False for name in graph.blobs}
    backward_indices = [i for i, node in enumerate(graph.nodes)
                        if train and node.layer.has_backward and any(needs_grad[t] for t in node.tops)]
    backward_set = set(backward_indices)
    kept = set()
    for node in (graph.nodes[i] for i in backward_indices):
        kept.update(node.bottoms[i] for i in node.layer.keeps_bottoms)
        kept.update(node.tops[i] for i in node.layer.keeps_tops)

    for node_index, node in enumerate(graph.nodes):
        layer = node.layer
        for top, shape in zip(node.tops, layer.top_shapes):
            category = INPUT if layer.is_data else (STASH if top in kept else FEATURE)
            add("blob", top, shape, layer.dtype, category, layer.name)
        params = []
        for index, decl in enumerate(layer.params):
            params.append(add("param", f"{layer.name}.{decl.name}", decl.shape, layer.dtype, WEIGHTS, layer.name,
                              part=decl.name))
        saved = {}
        for saved_name, decl in layer.saved.items():
            saved[saved_name] = add("saved", f"{layer.name}.{saved_name}", decl.shape,
                                    decl.dtype or layer.dtype,
                                    STASH if node_index in backward_set else FEATURE, layer.name, part=saved_name)
        steps.append(Step("forward", layer, {
            "x": [f"blob:{b}" for b in node.bottoms], "y": [f"blob:{t}" for t in node.tops],
            "p": params, "saved": saved, "ws": _add_workspace(buffers, layer, "forward")}))

    outputs = {name: f"blob:{name}" for name in graph.outputs()}
    loss_weights = {f"blob:{name}": weight for name, weight in graph.loss_weights.items()}
    if not train:
        return Program(graph, buffers, steps, outputs, loss_weights)

    for name, weight in graph.loss_weights.items():
        if needs_grad[name]:
            seed = add("grad", name, graph.blobs[name].shape, graph.nodes[0].layer.dtype,
                       GRADIENT, graph.nodes[graph.blobs[name].producer].layer.name)
            steps.append(Step("seed", None, {"target": seed, "value": weight}))

    partial_count = {}
    for node_index in reversed(backward_indices):
        node = graph.nodes[node_index]
        layer = node.layer
        blocks = _row_blocks(layer, block_bytes) if fused_update else []
        gy = []
        for top, shape in zip(node.tops, layer.top_shapes):
            if needs_grad[top]:
                gy.append(f"grad:{top}")
            else:   # a top nobody differentiates through: its gradient is zero
                zero = add("zero", top, shape, layer.dtype, GRADIENT, layer.name)
                steps.append(Step("zero", None, {"target": zero}))
                gy.append(zero)
        gx, accumulate = [], []
        for index, bottom in enumerate(node.bottoms):
            if not (needs_grad[bottom] and _propagates(graph, layer, index)):
                gx.append(None)
                continue
            count = partial_count.get(bottom, 0)
            partial_count[bottom] = count + 1
            gx.append(add("grad", bottom, graph.blobs[bottom].shape, layer.dtype, GRADIENT, layer.name,
                          part=str(count) if count else ""))
            name = gx[-1]
            if count:
                accumulate.append((f"grad:{bottom}", name))
        gp = []
        for index, decl in enumerate(layer.params):
            if decl.trained:
                shape = (blocks[0][1],) + tuple(decl.shape[1:]) if index == 0 and blocks else decl.shape
                grad = add("pgrad", f"{layer.name}.{decl.name}", shape, layer.dtype, WEIGHT_GRADS, layer.name,
                           part=decl.name)
                gp.append(grad)
                if fused_update:
                    buffers[grad].pinned = False
            else:
                gp.append(None)
        forward = steps[node_index]
        # which input gradients the backward writes: a layer may size its workspace by them
        gx_needed = tuple(name is not None for name in gx)
        x = [f"blob:{b}" if i in layer.keeps_bottoms else None for i, b in enumerate(node.bottoms)]
        steps.append(Step("backward", layer, {
            # with blocks, the weight gradient's steps read x; this one needs only gy and W
            "x": [None] * len(x) if blocks else x,
            "y": [f"blob:{t}" if i in layer.keeps_tops else None for i, t in enumerate(node.tops)],
            "gy": gy, "gx": gx, "p": forward.args["p"], "gp": [None] + gp[1:] if blocks else gp,
            "saved": dict(forward.args["saved"]), "ws": _add_workspace(buffers, layer, "backward", gx_needed)}))
        for target, source in accumulate:
            steps.append(Step("accumulate", None, {"target": target, "source": source}))
        if fused_update:
            _add_updates(layer, buffers, steps, add, blocks, {"x": x, "gy": gy, "gx": [None] * len(gx)})

    if not fused_update:
        for node in graph.nodes:
            _add_updates(node.layer, buffers, steps, add)
    for node in graph.nodes:    # force_backward's input gradients: readable after the run
        for top in node.tops if node.layer.is_data else ():
            if f"grad:{top}" in buffers:
                outputs[f"grad:{top}"] = f"grad:{top}"
    return Program(graph, buffers, steps, outputs, loss_weights)


# a multiple of the rows that OpenBLAS's sgemm kernels tile (24 on Haswell and Zen, 16 with
# AVX-512): blocks starting there are rounded as the same rows of the whole product, on one thread
ROW_ALIGN = 192


def _row_blocks(layer, block_bytes):
    """[(first, end)]: the blocks of rows of `layer`'s weight gradient where the blocked update
    makes it a block at a time: about as many as its bytes over `block_bytes`, of equal rows
    (a multiple of ROW_ALIGN where the gradient has more; the last block may have fewer). []
    where it is made whole: no `block_bytes`, a layer that cannot, a frozen weight, or a
    gradient of no more bytes."""
    if block_bytes is None or not layer.weight_grad_in_rows or not layer.params or not layer.params[0].trained:
        return []
    shape = layer.params[0].shape
    row_bytes = int(np.prod(shape[1:])) * np.dtype(layer.dtype).itemsize
    if row_bytes * shape[0] <= block_bytes:
        return []
    count = -(-row_bytes * shape[0] // block_bytes)
    rows = -(-shape[0] // count)
    if shape[0] > ROW_ALIGN:
        rows = max(ROW_ALIGN, rows - rows % ROW_ALIGN)
    return [(first, min(first + rows, shape[0])) for first in range(0, shape[0], rows)]


def _add_updates(layer, buffers, steps, add, blocks=(), reads=None):
    """The SGD update steps of the trained parameters of `layer` that got a gradient; the first
    parameter's as a backward step and an update step per block of rows where `blocks` are
    given (the backward steps read what `reads` names: x, gy, and gx, all None)."""
    for index, decl in enumerate(layer.params):
        if not decl.trained:
            continue
        weight, grad, momentum = param_buffer_names(layer, index)
        if grad not in buffers:     # the layer's output reaches no loss
            continue
        add("momentum", f"{layer.name}.{decl.name}", decl.shape, layer.dtype, OPTIMIZER_STATE, layer.name,
            part=decl.name)
        scratch = add("ws", f"{layer.name}.update.{decl.name}", (min(int(np.prod(decl.shape)), UPDATE_CHUNK),),
                      layer.dtype, WORKSPACE, layer.name, part=decl.name)
        update = {"param": weight, "grad": grad, "momentum": momentum, "ws": scratch,
                  "lr_mult": decl.lr_mult, "decay_mult": decl.decay_mult}
        if index == 0 and blocks:
            for rows in blocks:
                steps.append(Step("backward", layer, {**reads, "y": [], "p": [], "gp": [grad], "saved": {},
                                                      "ws": {}, "rows": rows}))
                steps.append(Step("update", layer, {**update, "rows": rows}))
        else:
            steps.append(Step("update", layer, update))
