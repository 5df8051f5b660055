"""What every call passes through before its handler runs.

Token and TLS security (``security``), admission: the graceful stop's gate,
backpressure and undecodable requests (``limits``), the shard identity check
(``shard``), stalled request streams (``_stall``), the hook machinery they share
(``_handlers``: each method's hooks laid out once as a plan) and the one table
from domain errors to gRPC status codes (``_status``). It may import ``errors``
only; ``rpc``, ``replication`` and the process wiring import it.
"""
