"""The gRPC adapter: the servicer and its RPC families.

``service`` is the servicer, the union of the RPC families ``_groups``, ``_rows``
and ``_tensors`` (their decorators and base class in ``_common``); ``_convert``
converts protobuf messages to the store's records and back, and ``_transports`` gives
a request's gradients and its reply's sink, whichever way the bytes travel. It
decodes a request, calls the store and maps errors to status codes, and holds no
state of its own. It may import ``interceptors`` (the status table, the in-flight
byte budget), ``transports``, ``durability``, ``store``, ``kernels`` and ``errors``;
only the process wiring imports it.
"""
