"""A PyTorch model's state dict to and from a .safetensors file, with the trained
values of its ``RemoteOptimizer`` group.

``save_safetensors`` copies the server's X into the parameters (``pull``), then
writes ``model.state_dict()`` (parameters and buffers, by their state-dict names,
tied weights once) with the ``safetensors`` package; ``load_safetensors`` loads such
a file into the model and, given the optimizer, makes the loaded values the
server's X (``RemoteOptimizer.send_parameters``). Install with
``pip install 'onnxps[torch,safetensors]'``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from onnxps.wire.weights import need

from ._optimizer import RemoteOptimizer

__all__ = ["load_safetensors", "save_safetensors"]


def _library() -> Any:
    need("safetensors", "safetensors", "a PyTorch model's .safetensors file")
    return need("safetensors.torch", "safetensors", "a .safetensors file")


def save_safetensors(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    optimizer: RemoteOptimizer | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``model.state_dict()`` to ``path``; with ``optimizer``, the server's X
    first copied into the parameters (its group's trained values)."""
    st = _library()
    if optimizer is not None:
        optimizer.pull()
    st.save_model(model, os.fspath(path), dict(metadata) if metadata else None)


def load_safetensors(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    optimizer: RemoteOptimizer | None = None,
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Load a .safetensors file into ``model`` (as ``load_state_dict``: the names of
    the missing and unexpected keys, an error for either when ``strict``); with
    ``optimizer``, the loaded values then become its group's X on the server (its
    optimizer state and T kept)."""
    st = _library()
    missing, unexpected = st.load_model(model, os.fspath(path), strict=strict)
    if optimizer is not None:
        optimizer.send_parameters()
    return list(missing), list(unexpected)
