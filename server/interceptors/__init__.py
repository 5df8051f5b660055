"""What every call passes through before its handler runs.

Token and TLS security (``security``), backpressure and undecodable requests
(``limits``), the shard identity check (``shard``), the graceful stop's gate
(``_gate``), stalled request streams (``_stall``), the hook machinery they share
(``_handlers``) and the one table from domain errors to gRPC status codes
(``_status``). It may import ``errors`` only; ``rpc``, ``replication`` and the
process wiring import it.
"""
