"""A training batch norm's backward pass as one kernel: its statistics, its input gradient and
its parameters' gradients.

Written with Relax ops (norm.py's general formula), the backward pass of one batch norm became
a dozen kernels, each reading or writing a whole activation: the centered input, its square,
the normalized input, `dy * gamma`, its product with the normalized input, and so on. On the
benchmark CNN's training step that was some 20 passes over a 9 MiB activation per layer.

Here, over the axes ``A`` the statistics run on (``n`` elements per channel), with
``xc = x - mean_A(x)`` and ``inv = 1 / sqrt(mean_A(xc^2) + eps)``:

    dbeta  = sum_A(dy)
    dgamma = sum_A(dy * xc) * inv
    dx     = gamma * inv * (dy - dbeta / n - xc * inv^2 * sum_A(dy * xc) / n)

which is norm.py's ``inv * (gh - mean(gh) - xh * mean(gh * xh))`` with ``gh = gamma * dy`` and
``xh = xc * inv``. The four sums keep the channel axis and the input gradient reads them at its
channel, so the CPU schedule runs all of it one channel at a time (schedules/reduction.py,
`_schedule_channels`): x and dy come from memory once and are read again from cache. Over
rows that no vector divides (1981 samples) each sum is cut after the rows' whole vectors
(tvmgraph/ragged_sums.py).
"""

from __future__ import annotations

import math

from tvm import te, tirx

from ..ragged_sums import ragged_sum, splits


def batch_norm_backward(x: te.Tensor, dy: te.Tensor, gamma: te.Tensor | None, axis: int,
                        epsilon: float) -> list[te.Tensor]:
    """``[dx, dgamma, dbeta]`` of a training batch norm of `x` over every axis but `axis`
    (`gamma` None: no scale)."""
    shape = list(x.shape)
    dtype = x.dtype
    reduced = [i for i in range(len(shape)) if i != axis]
    count = tirx.Cast(dtype, math.prod(shape[i] for i in reduced))  # n, symbolic with a dynamic batch

    def channel_sum(name: str, term) -> te.Tensor:
        """``sum_A(term(index))`` per channel, `index` the element of x at channel c."""
        if splits(x, reduced):  # rows no vector divides: their whole vectors, then their tails
            return ragged_sum(x, reduced, term=term, name=name)

        def body(c):
            axes = [te.reduce_axis((0, shape[i]), name=f"r{i}") for i in reduced]
            index = list(axes)
            index.insert(axis, c)
            return te.sum(term(index), axis=axes)
        return te.compute((shape[axis],), body, name=name)

    x_sum = channel_sum("x_sum", lambda i: x[tuple(i)])

    def centered(i):
        return x[tuple(i)] - x_sum[i[axis]] / count

    square_sum = channel_sum("centered_square_sum", lambda i: centered(i) * centered(i))
    dy_sum = channel_sum("dy_sum", lambda i: dy[tuple(i)])
    dy_centered_sum = channel_sum("dy_centered_sum", lambda i: dy[tuple(i)] * centered(i))

    def inv_std(c):
        return tirx.rsqrt(square_sum[c] / count + tirx.const(epsilon, dtype))

    def dx_at(*i):
        c = i[axis]
        scale = inv_std(c) if gamma is None else gamma[c] * inv_std(c)
        spread = inv_std(c) * inv_std(c) * dy_centered_sum[c] / count
        return scale * (dy[i] - dy_sum[c] / count - centered(list(i)) * spread)

    dx = te.compute(shape, dx_at, name="dx")
    dgamma = te.compute((shape[axis],), lambda c: dy_centered_sum[c] * inv_std(c), name="dgamma")
    return [dx, dgamma, dy_sum]
