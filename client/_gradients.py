"""A push's gradients as the client sends them: Python lists, tuples and numbers
made arrays of the group's dtype, NumPy arrays taken as they are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["gradient_arrays", "native_arrays"]

Array = np.ndarray[Any, Any]


def gradient_arrays(gradients: Sequence[Any], dtype: np.dtype[Any] | None) -> Any:
    """The gradients of a push, with Python lists, tuples and numbers made arrays
    of the group's ``dtype`` when it is known (NumPy would make them float64,
    which a float32 group refuses). Arrays are kept as they are: one of the wrong
    dtype is the caller's to convert, and the server says so."""
    if dtype is None:
        return gradients
    return tuple(
        np.asarray(g, dtype)
        if isinstance(g, list | tuple | int | float) and not isinstance(g, bool)
        else g
        for g in gradients
    )


def native_arrays(gradients: Sequence[Any], dtype: np.dtype[Any] | None) -> list[Array]:
    """What ``gradient_arrays`` then ``np.asarray`` make of a native push's
    gradients, in one pass: a NumPy array (the common case) is taken as it is."""
    ndarray, converted = np.ndarray, (list, tuple, int, float)
    arrays = []
    for g in gradients:
        if type(g) is not ndarray:
            if dtype is not None and isinstance(g, converted) and type(g) is not bool:
                g = np.asarray(g, dtype)
            else:
                g = np.asarray(g)
        arrays.append(g)
    return arrays
