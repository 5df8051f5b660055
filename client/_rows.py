"""Row calls of both clients: push and pull some rows of a group's tensors, and
list, count and export the rows of an ids table (``RowsOps``, a part of
``ClientCore``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import header_tensor, tensor_to_array
from onnxps.wire.encoding import Encoding, encode

from ._grpc_transport import resending
from ._ops import Call, Deadline, Op, unary_request, what
from ._records import PushResult, RowsPage
from ._replies import as_indices, row_gradients, rows_reader

if TYPE_CHECKING:
    from ._host import CoreHost as _Core
else:
    _Core = object

__all__ = ["RowsOps"]

Array = np.ndarray[Any, Any]


class RowsOps(_Core):
    """The row operations; the client core supplies the rest (``CoreHost``)."""

    def _push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        *,
        base_version: int | None = None,
        learning_rate: float | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
    ) -> Op[PushResult]:
        """One step in which only the given rows change.

        ``gradients`` maps a tensor name to ``(indices, rows)`` (int64 (k,) and
        (k, *shape[1:])) or to a dense gradient of the whole tensor; tensors not
        named keep every row. Repeated indices are summed first. The indices and rows
        travel in ~1 MiB chunks (no size ceiling); a push the server did not answer
        (UNAVAILABLE) is resent with the same seq, and answered once. ``encoding``
        (None: the client's ``gradient_encoding``) encodes the rows as ``push``
        does; indices travel as they are."""
        deadline = self._deadline(timeout)
        enc = self._encoding(encoding, self.gradient_encoding, "encoding")
        return self._route.push_rows(
            group, gradients, base_version, learning_rate, deadline, enc
        )

    def _rows_push_op(
        self,
        group: str,
        part: str,
        gradients: Mapping[str, Any],
        base_version: int | None,
        learning_rate: float | None,
        deadline: Deadline,
        encoding: Encoding = "native",
    ) -> Op[PushResult]:
        """A row push to ``part``, the name of ``group`` on the server it goes to."""
        header = pb.PushRowsHeader(
            group=part, client_id=self.client_id, seq=next(self._seq)
        )
        if base_version is not None:
            header.base_version = base_version
        if learning_rate is not None:
            header.learning_rate = learning_rate
        entries: list[tuple[str, Array | None, Array]] = []
        for name, g in gradients.items():
            if isinstance(g, tuple):
                rows = encode(g[1], encoding, f"rows of {name!r}")
                entries.append((name, as_indices(g[0], name), rows))
            else:
                entries.append(
                    (name, None, encode(g, encoding, f"gradient of {name!r}"))
                )
        arrays = row_gradients(header, entries)
        msg = yield from self._rows_send_op(group, header, arrays, deadline)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, None)

    def _rows_send_op(
        self,
        group: str,
        header: pb.PushRowsHeader,
        arrays: list[Array],
        deadline: Deadline,
    ) -> Op[Any]:
        """Send a row push (``row_gradients`` built it), resent while unanswered:
        the reply message."""
        what = f"the row push to group {group} (seq {header.seq}) was not answered"
        chunks = self._chunks(pb.PushRowsRequest, header, arrays)
        call = Call("PushRows", chunks, deadline, what)
        return (yield from resending(call, group, header.seq, self.address))

    def _pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> Op[dict[str, Array]]:
        """Rows of tensors: ``{name: indices}`` in, ``{name: rows}`` out (with
        ``state``, also ``"V:name"`` and ``"H:name"`` as the operator has them)."""
        deadline = self._deadline(timeout)
        return self._route.pull_rows(group, selections, state, min_version, deadline)

    def _rows_pull_op(
        self,
        group: str,
        part: str,
        selections: Mapping[str, Any],
        state: bool,
        min_version: int | None,
        deadline: Deadline,
    ) -> Op[dict[str, Array]]:
        """A row pull from ``part``, the name of ``group`` on the server it asks."""
        header = pb.PullRowsHeader(group=part, with_state=state)
        if min_version is not None:
            header.min_version = min_version
        arrays = []
        for name, idx in selections.items():
            indices = as_indices(idx, name)
            header.tensors.add(name=name, indices=header_tensor(indices))
            arrays.append(indices)
        chunks = self._chunks(pb.PullRowsRequest, header, arrays)
        what = f"the row pull of group {group} was not answered"
        names, rows = yield Call("PullRows", chunks, deadline, what, rows_reader)
        return dict(zip(names, rows, strict=True))

    def _list_rows(
        self,
        group: str,
        table: str,
        *,
        page_token: str = "",
        page_size: int = 0,
        values: bool = False,
        state: bool = False,
        timeout: float | None = None,
    ) -> Op[RowsPage]:
        """A page of an ids table's ids, ascending: from the first (``page_token``
        "") or after the page whose ``next_page_token`` is given; at most
        ``page_size`` ids (0: 1000; the server may return fewer), with their X rows
        (``values``) and V, H rows (``state``)."""
        deadline = self._deadline(timeout)
        return self._route.list_rows(
            group, table, page_token, page_size, values, state, deadline
        )

    def _list_rows_op(
        self,
        group: str,
        table: str,
        page_token: str,
        page_size: int,
        values: bool,
        state: bool,
        deadline: Deadline,
    ) -> Op[RowsPage]:
        req = pb.ListRowsRequest(
            group=group,
            table=table,
            page_token=page_token,
            page_size=page_size,
            with_values=values,
            with_state=state,
        )
        msg = yield Call("ListRows", unary_request(req), deadline, what("ListRows"))
        return RowsPage(
            tensor_to_array(msg.ids, "ids").copy(),
            {t.name: tensor_to_array(t, t.name).copy() for t in msg.rows},
            msg.next_page_token,
            int(msg.row_count),
            int(msg.update_count),
        )

    def _count_rows(
        self, group: str, table: str, *, timeout: float | None = None
    ) -> Op[int]:
        """Rows an ids table holds."""
        info = yield from self._describe_group(group, timeout=timeout)
        if table not in info.tables:
            held = ", ".join(info.tables) or "none"
            raise ValueError(
                f"group {group!r} has no ids table {table!r}; its ids tables: {held}"
            )
        return info.tables[table].row_count

    def _export_rows(
        self,
        group: str,
        table: str,
        *,
        state: bool = False,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> Op[tuple[Array, dict[str, Array]]]:
        """Every id of an ids table ascending and its rows (X, and V, H with
        ``state``), read page by page (each page under ``timeout``)."""
        pages: list[RowsPage] = []
        token = ""
        while True:
            page = yield from self._list_rows(
                group,
                table,
                page_token=token,
                page_size=page_size,
                values=True,
                state=state,
                timeout=timeout,
            )
            pages.append(page)
            token = page.next_page_token
            if not token:
                break
        ids = np.concatenate([p.ids for p in pages])
        rows = {k: np.concatenate([p.rows[k] for p in pages]) for k in pages[0].rows}
        return ids, rows
