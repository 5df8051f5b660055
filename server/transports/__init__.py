"""How a call's bytes reach the server beside its unary messages.

Streamed chunks landing in reused buffers (``_receive``: where a streamed push's
gradients are received), the data channel's sockets beside gRPC (``_datachannel``,
who may shake hands in ``_handshakes``), frame calls on those sockets (``_frames``),
same-host shared memory (``_shm``, the caller's uid from ``_peercred``) and serving
on a Unix domain socket (``_unix``). It moves and checks bytes and never applies
them: it may import ``store`` (buffers and waits), ``kernels`` (the finiteness check)
and ``errors``; ``rpc`` and the process wiring import it.
"""
