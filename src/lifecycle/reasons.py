"""Why a request failed, as small stable integer codes.

The code travels inside the reduced word (see :mod:`lifecycle.core.packing`), so
it must fit in :data:`REASON_BITS` bits and its numeric order is the
*priority* order: when several ranks fail the same request for different
reasons in the same step, MIN keeps the smallest code, and every rank ends up
with that one reason and the rank it came from. Everything else about a
reason (its verdict sources, deadline, default recovery, whether it counts
against a peer) is its row in :mod:`lifecycle.rules.reasons`.

Priority, most specific cause first:

=====  =====================  =================================================
code   reason                 why it ranks here
=====  =====================  =================================================
0      ABORTED                a client asked for it; everything else follows
1      PEER_DEAD              the peer is gone; transfer errors are symptoms
2      BOOTSTRAP_TIMEOUT      the rendezvous never completed
3      WAITING_TIMEOUT        metadata was sent, the data never landed
4      METADATA_CORRUPT       a row carries another request's room
5      TRANSFER_ERROR         the engine reported a failed write or read
6      INVALID_STATUS         a backend returned a value outside KVPoll
7      LOCAL_EXCEPTION        a poller raised; caught so the group stays in step
8      INJECTED_FAULT         a fault plan said so (tests)
9      UNKNOWN                Failed with no reason given (e.g. a plain backend)
10     CHECKSUM_MISMATCH      the KV digest of the committed bytes differs from
                              the one prefill computed over the bytes it sent
11     HOOK_ERROR             a user hook (gate, staging, fault hook, metadata
                              source, failure reasons) or a batch poll's index
                              lookup misbehaved: it says nothing about the
                              transfer, so any real cause on another rank wins
15     NONE                   not failed
=====  =====================  =================================================
"""

from __future__ import annotations

import enum

__all__ = ["FailureReason", "REASON_BITS"]

REASON_BITS = 4


class FailureReason(enum.IntEnum):
    ABORTED = 0
    PEER_DEAD = 1
    BOOTSTRAP_TIMEOUT = 2
    WAITING_TIMEOUT = 3
    METADATA_CORRUPT = 4
    TRANSFER_ERROR = 5
    INVALID_STATUS = 6
    LOCAL_EXCEPTION = 7
    INJECTED_FAULT = 8
    UNKNOWN = 9
    CHECKSUM_MISMATCH = 10
    HOOK_ERROR = 11
    NONE = (1 << REASON_BITS) - 1

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")
