"""A KV digest over exactly the bytes one leg of a request moves: the hash
(:mod:`.hashing`) and the parts of a leg it covers (:mod:`.parts`)."""

from transport.digest.hashing import (
    ALGORITHM,
    NO_DIGEST,
    LegDigest,
    Part,
    Pending,
    Progress,
    Views,
    digest,
    flip,
    measure,
    new_hasher,
    signature,
)
from transport.digest.parts import (
    decode_parts,
    decode_progress,
    landing_note,
    leg_parts,
    prefill_digest,
    prefill_parts,
    state_parts,
)

__all__ = [
    "ALGORITHM",
    "NO_DIGEST",
    "Part",
    "Views",
    "LegDigest",
    "Pending",
    "new_hasher",
    "digest",
    "signature",
    "flip",
    "state_parts",
    "measure",
    "leg_parts",
    "prefill_parts",
    "decode_parts",
    "prefill_digest",
    "decode_progress",
    "landing_note",
    "Progress",
]
