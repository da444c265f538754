"""A KV digest over exactly the bytes one leg of a request moves: the hash
(:mod:`.hashing`), the parts of a leg it covers (:mod:`.parts`), the CPU
time hashing costs (:mod:`.clock`) and the hash's own speed (:mod:`.speed`)."""

from transport.digest import clock, hashing, parts, speed
from transport.digest.clock import *  # noqa: F403
from transport.digest.hashing import *  # noqa: F403
from transport.digest.parts import *  # noqa: F403
from transport.digest.speed import *  # noqa: F403

__all__ = [*clock.__all__, *hashing.__all__, *parts.__all__, *speed.__all__]
