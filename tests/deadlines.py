"""What a call says about its deadline, instead of timing it with a wall clock.

A client's DEADLINE_EXCEEDED message names the budget it waited for ("... was not
answered within 0.2 s"), and each resend of a push to an unavailable server is logged
with its pause: tests assert on these, which a loaded machine cannot change.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

_WITHIN = re.compile(r" within ([0-9.e-]+) s(?: \(|$)")


def waited_for(details: str) -> float:
    """The seconds a "... within N s" message says the call had."""
    found = _WITHIN.search(details)
    assert found, f"not a deadline message: {details!r}"
    return float(found.group(1))


# The client's log line before it resends a push (client/_requests.py, _resending).
RESEND = "push to %s seq %d: %s; resending in %.1f s"


def resend_pauses(records: Iterable[logging.LogRecord]) -> list[float]:
    """The pause before each resend of a push, as the client logged it."""
    pauses = []
    for record in records:
        if record.msg == RESEND and isinstance(record.args, tuple):
            pause = record.args[-1]
            assert isinstance(pause, float), record.args
            pauses.append(pause)
    return pauses
