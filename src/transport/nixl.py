"""Registry entry for NIXL (UCX). Not implemented in this release.

The registry reports it as unavailable with what to install, or, when the
NIXL package is present, that this backend is not written yet -- rather
than offering a backend that does not move bytes.
"""

from __future__ import annotations

from transport.errors import BackendUnavailable


def probe() -> None:
    try:
        import nixl  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            "nixl",
            f"cannot import nixl ({e})",
            "Install it with `pip install 'pd-lifecycle[nixl]'` (needs torch installed first)",
        ) from None
    raise BackendUnavailable(
        "nixl",
        "the NIXL backend is not implemented in this release",
        "Use the mooncake backend (TCP) for real transfers on CPU machines",
    )
