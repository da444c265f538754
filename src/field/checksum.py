"""The KV layout signature the field ships beside a KV digest.

Two sides can compare digests only when they cover the same bytes: another
TP width, PP split, dtype or page layout holds other bytes under the same
sizes. The field names the layout with :func:`kv_layout_signature`, a
positive 63-bit integer that is never 0 (0 marks "no digest" in the metadata
row), and skips the comparison when the two sides' signatures differ. The
digest itself is the recovery work's; this module gives the names and their
semantics, and the same value as SGLang 0.5.23 for the same layout.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["kv_layout_signature", "NO_DIGEST"]

#: the metadata row's checksum fields when no digest was shipped
NO_DIGEST = 0


def _layout(kv_args: Any) -> tuple[Any, ...]:
    def value(x: Any) -> Any:
        return getattr(x, "value", x)

    return (
        getattr(kv_args, "page_size", None),
        getattr(kv_args, "kv_cache_dtype_str", None),
        getattr(kv_args, "kv_layout", None),
        getattr(kv_args, "swa_kv_cache_layout", None),
        [value(t) for t in getattr(kv_args, "state_types", None) or []],
        list(getattr(kv_args, "kv_item_lens", None) or []),
        [list(lens) for lens in getattr(kv_args, "state_item_lens", None) or []],
    )


def kv_layout_signature(kv_args: Any) -> int:
    """A positive, non-zero 63-bit name of the KV layout ``kv_args`` describes.

    Equal for equal layouts (page size, KV dtype, page layouts, state kinds,
    per-buffer item sizes), different, with overwhelming probability, for
    different ones. A field absent from ``kv_args`` counts as None.
    """
    text = repr(_layout(kv_args)).encode()
    word = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
    return (word >> 1) | 1
