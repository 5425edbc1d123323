"""Can TVM build and run one CUDA kernel here? (.ci/gpu_check.sh: NVRTC first, else nvcc)"""

import numpy as np
import tvm
from tvm.script import tirx as T


@T.prim_func
def add_one(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
    for i in T.thread_binding(256, thread="threadIdx.x"):
        b[i] = a[i] + 1.0


if __name__ == "__main__":
    lib = tvm.compile(add_one, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    dev = tvm.cuda(0)
    a = tvm.runtime.tensor(np.arange(256, dtype="float32"), dev)
    b = tvm.runtime.empty((256,), "float32", dev)
    lib(a, b)
    assert (b.numpy() == np.arange(256) + 1).all()
    print("CUDA kernel built and ran")
