"""The arithmetic of a 2-D convolution's shapes: output sizes, padded and staging frames,
the column layout of the im2col passes, the input gradient's cost model and the sizes of
chunks and weight-gradient blocks. Pure functions of a `ConvGeometry` (and of plain numbers):
no layer state, no arrays.

Wc below is a column width: OW, or the width of a padded frame for stride-1 columns of a
padded input, whose rows share their zero padding (`frame_width`).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class ConvGeometry:
    """The shapes one convolution is set up for: input (N, C, H, W), output channels,
    groups, and (h, w) pairs of kernel, stride, pad, dilation and output size."""
    in_shape: tuple
    num_output: int
    group: int
    kernel: tuple
    stride: tuple
    pad: tuple
    dilation: tuple
    out_hw: tuple


def kernel_extent(k, dilation):
    """Input rows (columns) one window of a k-tap dilated kernel spans."""
    return dilation * (k - 1) + 1


def output_size(size, extent, stride, pad):
    """Outputs along an axis of `size` inputs, padded by `pad` on both sides (Caffe's rule)."""
    return (size + 2 * pad - extent) // stride + 1


def columns_per_group(geom):
    """K of the GEMM: the column length of one group, C/g * kh * kw."""
    n, c, h, w = geom.in_shape
    return (c // geom.group) * geom.kernel[0] * geom.kernel[1]


def is_pointwise(geom):
    """A 1x1 convolution with stride 1 and no padding: x itself is the column matrix."""
    return geom.kernel == (1, 1) and geom.stride == (1, 1) and geom.pad == (0, 0)


def overlap(offset, src_len, dst_len):
    """Slices (dst, src) of the overlap when a src of length src_len sits at `offset` in dst."""
    d0 = max(offset, 0)
    d1 = min(offset + src_len, dst_len)
    d1 = max(d1, d0)
    return slice(d0, d1), slice(d0 - offset, d1 - offset)


def frame_width(width, pad, reach):
    """Width of a stride-1 staging frame (a row of `width` inputs at column `pad`, zeros
    around it) whose im2col is read as contiguous runs of the flattened frame, for a kernel
    that reaches `reach` = dilation * (k - 1) columns. A window that runs past a row's right
    end continues at the start of the next row: the zeros there serve as its right padding,
    so the rows need `pad` zeros between them, not 2 * pad, and the frame must hold the
    `width + 2 * pad - reach` outputs of a row. Never wider than the plain padded row."""
    if pad < 0:
        return width + 2 * pad
    return min(width + 2 * pad, width + max(pad, 2 * pad - reach))


def transposed_cheaper(geom):
    """Whether gx as a stride-1 convolution of the padded gy (im2col of gy: O*kk*H*W
    columns, a GEMM over H*W pixels) beats the scatter of W^T gy (C*kk*OH*OW columns
    written, read back and added kh*kw times into gx). A cost model measured on a CPU:
    one element moved through memory costs about as much as 16 GEMM flops."""
    n, c, h, w = geom.in_shape
    o, g = geom.num_output, geom.group
    oh, ow = geom.out_hw
    transposed = o * h * w * (c / g / 50.0 + 1.0 / 3.0)
    scatter = c * oh * ow * (o / g / 50.0 + 2.0 / 3.0)
    return transposed <= scatter


def wide_x(geom):
    """Whether the im2col of x takes its columns at the staging frame's full width."""
    return geom.pad != (0, 0) and geom.stride[1] == 1 and geom.kernel[1] > 1


def x_pass(geom):
    """(Wc, slack) of the im2col of x: the column width and the elements read past the
    staged input's end. Stride-1 columns of a staged (padded) input are taken at its full
    width Wp (`wide_x`): each (channel, kernel offset, sample) column is then one
    contiguous run of OH*Wp elements of the flattened padded input, the fastest copy,
    and the extra Wp - OW columns (garbage) are dropped from the GEMM's output and meet
    zeros in gy for the weight gradient. The last row of the last channel reads up to
    dw*(kw-1) elements past the input: the staging buffer holds that many zeros more."""
    if wide_x(geom):
        return frame_hw(geom)[1], geom.dilation[1] * (geom.kernel[1] - 1)
    return geom.out_hw[1], 0


def gy_pad(geom):
    """(offset_h, offset_w, Hg, Wg): where gy sits in the padded gy of the transposed conv
    (a frame whose rows share their zero padding when its columns are wide)."""
    n, c, h, w = geom.in_shape
    (kh, kw), (dh, dw), (ph, pw) = geom.kernel, geom.dilation, geom.pad
    qh, qw = dh * (kh - 1) - ph, dw * (kw - 1) - pw
    wg = w + dw * (kw - 1)
    if (qh, qw) != (0, 0) and kw > 1:
        wg = frame_width(geom.out_hw[1], qw, dw * (kw - 1))
    return qh, qw, h + dh * (kh - 1), wg


def gy_pass(geom):
    """(Wc, slack) of the im2col of the padded gy (the transposed input gradient)."""
    qh, qw, hg, wg = gy_pad(geom)
    kw, dw = geom.kernel[1], geom.dilation[1]
    if (qh, qw) != (0, 0) and kw > 1:
        return wg, dw * (kw - 1)
    return geom.in_shape[3], 0


def col_elems(geom, phase, transposed_backward):
    """Elements of one sample's column buffer (the backward's may also hold the im2col of
    the padded gy, with the transposed input gradient)."""
    n, c, h, w = geom.in_shape
    kh, kw = geom.kernel
    oh, ow = geom.out_hw
    elems = c * kh * kw * oh * x_pass(geom)[0]
    if phase == "backward" and transposed_backward:
        elems = max(elems, geom.num_output * kh * kw * h * gy_pass(geom)[0])
    return elems


def padded_hw(geom):
    """(Hp, Wp): the input's height and width with the zero padding on both sides."""
    n, c, h, w = geom.in_shape
    return h + 2 * geom.pad[0], w + 2 * geom.pad[1]


def frame_hw(geom):
    """(Hp, Wx): the frame x is staged in (at offset pad) for the im2col view: padded,
    with rows that share their zero padding when the columns are wide."""
    hp, wp = padded_hw(geom)
    if wide_x(geom):
        n, c, h, w = geom.in_shape
        wp = frame_width(w, geom.pad[1], geom.dilation[1] * (geom.kernel[1] - 1))
    return hp, wp


def chunk_samples(batch, per_sample_bytes, chunk_bytes, forced=None):
    """Samples in one batch chunk: `forced` if given (within 1..batch), else as many as fit
    `chunk_bytes` at `per_sample_bytes` each, at least one."""
    if forced:
        return max(1, min(batch, int(forced)))
    return max(1, min(batch, chunk_bytes // max(per_sample_bytes, 1)))


def gw_rows(geom, itemsize, block_bytes):
    """Output rows (per group) of the weight gradient that a later chunk computes at a
    time before adding them in: a block of about `block_bytes`, not a second dW."""
    per_row = geom.group * columns_per_group(geom) * itemsize
    return max(1, min(geom.num_output // geom.group, block_bytes // per_row))
