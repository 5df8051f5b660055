"""The kernel paths a kernel test runs against: NumPy, and numba's when installed.

A test module opts in with ``from kernel_paths import each_kernel_path``: the
autouse fixture (a test takes it as ``kernels``) sets ``ONNXPS_KERNELS`` for the
module, so every ``Stepper`` and ``apply_onnx`` in it runs once per path. Without
numba the numba run is skipped with the reason; CI installs numba through the
``test`` extra and runs both.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
NO_NUMBA = "numba is not installed (pip install 'onnxps[fast]'); NumPy path only"

KERNEL_PARAMS = [
    pytest.param("numpy", id="numpy"),
    pytest.param(
        "numba", id="numba", marks=pytest.mark.skipif(not HAVE_NUMBA, reason=NO_NUMBA)
    ),
]


@pytest.fixture(scope="module", autouse=True, params=KERNEL_PARAMS, name="kernels")
def each_kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel path of this run of the module: ``"numpy"`` or ``"numba"``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXPS_KERNELS", request.param)
        yield request.param
