"""The gRPC adapter: the servicer (``service``), its RPC families (``_groups``,
``_rows``, ``_tensors``, with the decorators and the base class they share in
``_common``), the conversion between protobuf messages and the store's records
(``_convert``) and, in ``_transports``, where a request's gradients come from and
where its reply's values go, whichever way the bytes travel. It decodes a request,
calls the store and maps errors to status codes; it holds no state of its own. It
may import ``interceptors`` (the status table, the in-flight byte budget),
``transports``, ``durability``, ``store``, ``kernels`` and ``errors``; nothing below
imports it.
"""
