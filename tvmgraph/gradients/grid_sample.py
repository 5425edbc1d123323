"""Gradient of ``image.grid_sample`` (``F.grid_sample``, ``grid_sampler_2d``) w.r.t. the input
and the grid, for bilinear and nearest sampling and zeros/border/reflection padding, following
aten's ``GridSampler.cpp`` backward.
"""

from __future__ import annotations

from tvm import relax

from ._common import dims_of, dtype_of, register, shape_of

op = relax.op


def _source_index(
    coord: relax.Expr, size: int, padding: str, align_corners: bool, dtype: str
) -> tuple[relax.Expr, relax.Expr]:
    """aten's ``grid_sampler_compute_source_index_set_grad``: the pixel coordinate of a
    normalized grid coordinate, and its derivative with respect to it."""

    def c(value: float) -> relax.Expr:
        return relax.const(value, dtype)

    if align_corners:
        pixel, scale = (coord + c(1)) * c((size - 1) / 2), (size - 1) / 2
    else:
        pixel, scale = ((coord + c(1)) * c(size) - c(1)) * c(0.5), size / 2
    grad = op.full_like(coord, c(scale))
    if padding == "reflection":
        low, high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        if low == high:
            return op.zeros_like(coord), op.zeros_like(coord)
        start, span = low / 2, (high - low) / 2
        shifted = pixel - c(start)
        negative = op.less(shifted, c(0))
        grad = op.where(negative, -grad, grad)
        shifted = op.abs(shifted)
        flips = op.floor(shifted / c(span))
        extra = shifted - flips * c(span)
        odd = op.equal(op.floor_mod(flips, c(2)), c(1))
        pixel = op.where(odd, c(span + start) - extra, extra + c(start))
        grad = op.where(odd, -grad, grad)
    if padding in ("border", "reflection"):
        # aten counts the borders as outside: the clipped coordinate's derivative is 0 there.
        inside = op.logical_and(op.greater(pixel, c(0)), op.less(pixel, c(size - 1)))
        grad = op.where(inside, grad, op.zeros_like(grad))
        pixel = op.clip(pixel, 0, size - 1)
    return pixel, grad


@register("relax.image.grid_sample")
def grid_sample_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y[n, c, h, w] = sum_k w_k(g[n, :, h, w]) x[n, c, p_k]`` over the sampled pixels ``p_k``
    (the 4 neighbours for bilinear, the nearest one for nearest; out of range reads 0).

    ``dx[n, c, p_k] += w_k dy[n, c, h, w]`` (a scatter-add over the flattened plane); for
    bilinear ``dg = sum_c dy sum_k x[n, c, p_k] dw_k/dpixel * dpixel/dg``, with ``dpixel/dg``
    from the unnormalization and the padding (0 where border/reflection clip, the sign flips
    of reflection); nearest sampling has ``dg = 0``, as in torch.
    """
    x, grid = orig_call.args
    attrs = orig_call.attrs
    if str(attrs.layout) != "NCHW" or str(attrs.method) not in ("bilinear", "nearest"):
        raise NotImplementedError(
            f"gradient of relax.image.grid_sample with layout={attrs.layout} and "
            f"method={attrs.method}: only NCHW bilinear and nearest sampling are supported")
    n, channels, height, width = shape_of(x)
    out_h, out_w = shape_of(grid)[2:]
    dtype = dtype_of(x)
    padding, align = str(attrs.padding_mode), bool(attrs.align_corners)
    gx = op.squeeze(op.strided_slice(grid, [1], [0], [1]), [1])
    gy = op.squeeze(op.strided_slice(grid, [1], [1], [2]), [1])
    ix, dix = _source_index(gx, width, padding, align, dtype)
    iy, diy = _source_index(gy, height, padding, align, dtype)
    count = out_h * out_w
    x_flat = op.reshape(x, [n, channels, height * width])
    grad = op.reshape(output_grad, [n, channels, count])

    def corner(col: relax.Expr, row: relax.Expr) -> tuple[relax.Expr, relax.Expr]:
        """The flat index of pixel (row, col), clamped into range, and whether it is in range."""
        inside = op.logical_and(
            op.logical_and(op.greater_equal(col, relax.const(0, dtype)),
                           op.less_equal(col, relax.const(width - 1, dtype))),
            op.logical_and(op.greater_equal(row, relax.const(0, dtype)),
                           op.less_equal(row, relax.const(height - 1, dtype))))
        col_i = op.astype(op.clip(col, 0, width - 1), "int64")
        row_i = op.astype(op.clip(row, 0, height - 1), "int64")
        index = op.reshape(row_i * relax.const(width, "int64") + col_i, [n, 1, count])
        return op.broadcast_to(index, [n, channels, count]), op.reshape(op.astype(inside, dtype), [n, 1, count])

    def scatter(parts: list[tuple[relax.Expr, relax.Expr]]) -> relax.Expr:
        indices = op.concat([index for index, _ in parts], axis=2)
        values = op.concat([value for _, value in parts], axis=2)
        zeros = op.zeros([n, channels, height * width], dtype)
        return op.reshape(op.scatter_elements(zeros, indices, values, axis=2, reduction="add"), shape_of(x))

    if str(attrs.method) == "nearest":
        index, inside = corner(op.round(ix), op.round(iy))
        return [scatter([(index, grad * inside)]), op.zeros(dims_of(grid), dtype)]

    one = relax.const(1, dtype)
    x0, y0 = op.floor(ix), op.floor(iy)
    wx, wy = op.reshape(ix - x0, [n, 1, count]), op.reshape(iy - y0, [n, 1, count])
    corners = {(dy_, dx_): corner(x0 + one if dx_ else x0, y0 + one if dy_ else y0)
               for dy_ in (0, 1) for dx_ in (0, 1)}
    weights = {(0, 0): (one - wy) * (one - wx), (0, 1): (one - wy) * wx,
               (1, 0): wy * (one - wx), (1, 1): wy * wx}
    x_grad = scatter([(index, grad * inside * weights[k]) for k, (index, inside) in corners.items()])
    values = {k: op.gather_elements(x_flat, index, 2) * inside for k, (index, inside) in corners.items()}
    along_x = (values[0, 1] - values[0, 0]) * (one - wy) + (values[1, 1] - values[1, 0]) * wy
    along_y = (values[1, 0] - values[0, 0]) * (one - wx) + (values[1, 1] - values[0, 1]) * wx
    gx_grad = op.reshape(op.sum(grad * along_x, [1]), [n, out_h, out_w]) * dix
    gy_grad = op.reshape(op.sum(grad * along_y, [1]), [n, out_h, out_w]) * diy
    return [x_grad, op.stack([gx_grad, gy_grad], 1)]
