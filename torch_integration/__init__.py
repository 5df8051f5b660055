"""onnxps for PyTorch: a ``torch.optim.Optimizer`` whose state lives on the server.

from onnxps.client import Adam, Client
from onnxps.torch import RemoteOptimizer

with Client("127.0.0.1:50051") as ps:
    opt = RemoteOptimizer(model.named_parameters(), ps, group="net", lr=1e-3)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()  # one push of every grad; the server's X written into the params

``BucketedOptimizer`` takes the same arguments and pushes the gradients in buckets
while backward runs (as DDP overlaps its allreduce); ``step()`` still returns with
the new X in the parameters.

Install with ``pip install 'onnxps[torch]'``. The model's weights, trained, to a
.safetensors file and back: ``save_safetensors(model, path, opt)``,
``load_safetensors(model, path, opt)`` (``pip install 'onnxps[torch,safetensors]'``).
"""

from ._buckets import BUCKET_BYTES, BucketedOptimizer
from ._optimizer import STATE_DICT_FORMAT_VERSION, RemoteOptimizer
from ._safetensors import load_safetensors, save_safetensors
from ._workers import run_workers, shard

__all__ = [
    "BUCKET_BYTES",
    "STATE_DICT_FORMAT_VERSION",
    "BucketedOptimizer",
    "RemoteOptimizer",
    "load_safetensors",
    "run_workers",
    "save_safetensors",
    "shard",
]
