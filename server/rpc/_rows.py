"""The row RPCs: PushRows and PullRows (some rows of a group's tensors) and
ListRows (an ids table's rows, page by page)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    chunk_frames,
    header_tensor,
    tensor_spec,
    write_tensor,
)

from ..errors import InvalidArgument
from ._common import (
    RpcFamily,
    cancellation_of,
    stream_header,
    streaming,
    timeout_of,
    unary,
)
from ._convert import (
    index_spec,
)

__all__ = ["RowRpcs"]

log = logging.getLogger("onnxps.service")

Array = np.ndarray[Any, Any]

# ListRows pages: ids per page by default and at most, and bytes of rows at most.
_PAGE_SIZE = 1000


_MAX_PAGE_SIZE = 100_000


_PAGE_BYTES = 2 << 20


class RowRpcs(RpcFamily):
    """PushRows, PullRows, ListRows."""

    @unary
    def PushRows(
        self, request_iterator: Iterable[pb.PushRowsRequest], context: Any
    ) -> pb.PushRowsResponse:
        req, it = stream_header(request_iterator, "header", "a PushRows", context)
        headers: list[pb.Tensor] = []
        names: list[str] = []
        for j, gr in enumerate(req.gradients):
            if gr.HasField("indices"):
                headers.append(gr.indices)
                names.append(f"gradients[{j}].indices ({gr.name!r})")
            headers.append(gr.values)
            names.append(f"gradients[{j}].values ({gr.name!r})")
        self.store.validate_push_rows(
            req.group,
            (
                (
                    gr.name,
                    index_spec(gr.indices, f"gradients[{j}].indices", req.group)
                    if gr.HasField("indices")
                    else None,
                    tensor_spec(gr.values, f"gradients[{j}].values", encoded=True),
                )
                for j, gr in enumerate(req.gradients)
            ),
        )
        arrays = iter(self._assemble(it, headers, names, context, encoded=True))
        gradients: dict[str, Array | tuple[Array, Array]] = {}
        for gr in req.gradients:
            if gr.HasField("indices"):
                gradients[gr.name] = (next(arrays), next(arrays))
            else:
                gradients[gr.name] = next(arrays)
        out = self.store.push_rows(
            req.group,
            gradients,
            client_id=req.client_id,
            seq=req.seq,
            base_version=req.base_version if req.HasField("base_version") else None,
            learning_rate=req.learning_rate if req.HasField("learning_rate") else None,
        )
        return pb.PushRowsResponse(
            update_count=out.update_count, applied=out.applied, duplicate=out.duplicate
        )

    @streaming
    def PullRows(
        self, request_iterator: Iterable[pb.PullRowsRequest], context: Any
    ) -> Iterator[Any]:
        req, it = stream_header(request_iterator, "header", "a PullRows", context)
        headers = [sel.indices for sel in req.tensors]
        names = [f"tensors[{j}].indices" for j in range(len(headers))]
        for h, what in zip(headers, names, strict=True):
            index_spec(h, what, req.group)
        indices = self._assemble(it, headers, names, context)
        selections = {
            sel.name: idx for sel, idx in zip(req.tensors, indices, strict=True)
        }
        if len(selections) != len(headers):
            raise InvalidArgument("a PullRows names each tensor at most once")
        waits = req.HasField("min_version")
        with self._reply_bytes(context, stream=True) as hold:
            out = self.store.pull_rows(
                req.group,
                selections,
                with_state=req.with_state,
                min_version=req.min_version if waits else None,
                timeout=timeout_of(context),
                cancellation=cancellation_of(context) if waits else None,
                reserve=functools.partial(hold.admit, what="this pull's reply carries"),
            )
            header = pb.PullRowsReply(
                update_count=out.update_count,
                rows=[
                    header_tensor(a, n)
                    for a, n in zip(out.arrays, out.names, strict=True)
                ],
            )
            yield pb.PullRowsResponse(header=header)
            yield from chunk_frames(pb.PullRowsResponse, out.arrays, self.chunk_bytes)

    @unary
    def ListRows(
        self, request: pb.ListRowsRequest, context: Any
    ) -> pb.ListRowsResponse:
        after = None
        if request.page_token:
            try:
                after = int(request.page_token)
            except ValueError:
                raise InvalidArgument(
                    f"page_token {request.page_token!r} is not one a ListRows "
                    "returned; pass an empty token to start from the first id"
                ) from None
        size = min(request.page_size or _PAGE_SIZE, _MAX_PAGE_SIZE)
        if request.with_values:
            row = self.store.describe(request.group)
            dims = {t.name: t.definition.dim for t in row.tables}
            states = len(row.attrs.state_names) if request.with_state else 0
            per_row = dims.get(request.table, 1) * row.dtype.itemsize * (1 + states)
            size = max(1, min(size, _PAGE_BYTES // per_row))
        page = self.store.list_rows(
            request.group,
            request.table,
            after=after,
            limit=size,
            with_values=request.with_values,
            with_state=request.with_state,
        )
        reply = pb.ListRowsResponse(
            next_page_token="" if page.next_after is None else str(page.next_after),
            row_count=page.row_count,
            update_count=page.update_count,
        )
        write_tensor(reply.ids, page.ids)
        for a, n in zip(page.rows, page.names, strict=True):
            write_tensor(reply.rows.add(), a, n)
        return reply
