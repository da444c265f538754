"""A KV digest over exactly the bytes one leg of a request moves: the hash
(:mod:`.hashing`) and the parts of a leg it covers (:mod:`.parts`)."""

from transport.digest import hashing, parts
from transport.digest.hashing import *  # noqa: F403
from transport.digest.parts import *  # noqa: F403

__all__ = [*hashing.__all__, *parts.__all__]
