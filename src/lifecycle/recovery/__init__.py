"""Recovery: what a decode group does about peers and requests that fail,
decided from agreed outcomes only, so every rank decides alike.

:mod:`lifecycle.recovery.peers` keeps each prefill peer's health (the
machine declared in :mod:`lifecycle.rules.peers`) and routes new requests
away from peers that keep failing, letting one probe through after a
cooldown of agreed steps.
"""

from lifecycle.recovery.peers import PeerChange, PeerHealth, PeerPolicy, PeerView
from lifecycle.rules.peers import COUNTS, PeerState

__all__ = ["PeerHealth", "PeerPolicy", "PeerView", "PeerChange", "PeerState", "COUNTS"]
