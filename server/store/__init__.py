"""The parameter store: groups, their state and where a push is applied, no gRPC.

``ParameterStore`` (``store``) delegates to a group's state (``_group``), the push
pipeline (``_push``), sync quorums (``_quorum``), waits for a version (``_waits``),
rows and ids tables (``_rows``, ``_ids``, ``_sparse``), flat buffers (``_flat``), the
order of a change (``_journaling``, ``_order``), value checks (``_checks``) and
shared read-only copies (``_shared``). It may import ``kernels`` and ``errors`` only
(and ``onnxps.wire``); everything that serves or persists it imports it. ``from
onnxps.server.store import ParameterStore`` names the public records of ``store``.
"""

from .store import (
    CURRENT_CALL,
    DEDUP_WINDOW,
    CallCancelled,
    CallLink,
    Cancellation,
    Consistency,
    GroupCapture,
    GroupRuntime,
    GroupView,
    Journal,
    LeaseView,
    ParameterStore,
    PullResult,
    PushOutcome,
    PushTicket,
    StoreLimits,
    ValuesSink,
    WorkerLease,
    combine_contributions,
)

__all__ = [
    "CURRENT_CALL",
    "DEDUP_WINDOW",
    "CallCancelled",
    "CallLink",
    "Cancellation",
    "Consistency",
    "GroupCapture",
    "GroupRuntime",
    "GroupView",
    "Journal",
    "LeaseView",
    "ParameterStore",
    "PullResult",
    "PushOutcome",
    "PushTicket",
    "StoreLimits",
    "ValuesSink",
    "WorkerLease",
    "combine_contributions",
]
