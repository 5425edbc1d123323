"""The default rule list of `ApplyCPUSchedules`, most specific first."""

from __future__ import annotations

from tvm.s_tir.dlight.base import ScheduleRule

from .attention import Attention
from .bilinear_upsample import BilinearUpsample
from .conv import Conv2d
from .conv1d import Conv1d
from .conv_grad import ConvWeightGradient
from .elementwise import Elementwise
from .fallback import Fallback
from .gemv import MatrixVector
from .im2col import Im2col
from .lstm_cell import LSTMCell
from .matmul import Matmul
from .reduction import Reduction


def default_rules() -> list[ScheduleRule]:
    """Attention, LSTM-step and bilinear-upsampling kernels, convolutions, matrix-vector, matmul,
    reductions, im2col copies, element-wise, then the catch-all `Fallback`."""
    return [Attention(), LSTMCell(), BilinearUpsample(), ConvWeightGradient(), Conv2d(), Conv1d(), MatrixVector(), Matmul(), Reduction(),
            Im2col(), Elementwise(), Fallback()]
