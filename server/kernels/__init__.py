"""ONNX-exact optimizer kernels (no grpc here).

The reference steps (``_apply``), the in-place production path (``_fused``), numba's
fused loops (``_numba``), the finiteness check (``_finite``) and the choice between
them (``_select``): where a push's gradients are stepped into X, V and H. It may
import ``errors`` only; ``store``, ``transports``, ``rpc`` and the process import it.
"""

from ._apply import STATE_DTYPES, apply_onnx, check_scalars, split_inputs
from ._attrs import (
    OPERATORS,
    AdagradAttrs,
    AdamAttrs,
    MomentumAttrs,
    OptimizerAttrs,
    make_attrs,
)
from ._fused import BLOCK_ELEMENTS, PARALLEL_MIN_ELEMENTS, Stepper, coefficients
from ._select import KERNEL_PATHS, fused_kernels, kernel_path, load_in_background

__all__ = [
    "BLOCK_ELEMENTS",
    "KERNEL_PATHS",
    "OPERATORS",
    "PARALLEL_MIN_ELEMENTS",
    "STATE_DTYPES",
    "AdagradAttrs",
    "AdamAttrs",
    "MomentumAttrs",
    "OptimizerAttrs",
    "Stepper",
    "apply_onnx",
    "check_scalars",
    "coefficients",
    "fused_kernels",
    "kernel_path",
    "load_in_background",
    "make_attrs",
    "split_inputs",
]
