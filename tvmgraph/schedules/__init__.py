"""Default CPU schedules for TIR kernels: fast code without tuning.

`ApplyCPUSchedules` is a module pass that gives each PrimFunc the first matching rule's
schedule; it goes right after `FuseTIR` in llvm pipelines. `ApplyGPUSchedules` does the same
with dlight's GPU rules for CUDA. See docs/schedules.md for what each
rule does and the speeds it reaches.
"""

from .apply import ApplyCPUSchedules as ApplyCPUSchedules
from .apply_gpu import ApplyGPUSchedules as ApplyGPUSchedules
from .conv import Conv2d as Conv2d
from .conv_grad import ConvWeightGradient as ConvWeightGradient
from .elementwise import Elementwise as Elementwise
from .fallback import Fallback as Fallback
from .gemv import MatrixVector as MatrixVector
from .im2col import Im2col as Im2col
from .matmul import Matmul as Matmul
from .reduction import Reduction as Reduction
from .rules import default_rules as default_rules
