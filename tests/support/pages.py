"""What each KV page holds in the transfer tests, so decode can check every byte."""

from __future__ import annotations

import torch


def pattern(room: int, pos: int, layer: int, page_bytes: int) -> torch.Tensor:
    """Page ``pos`` of ``room``'s KV on ``layer``: ``page_bytes`` bytes that differ
    from room to room, page to page and layer to layer."""
    base = (room * 131 + pos * 17 + layer * 7) % 251
    return (torch.arange(page_bytes, dtype=torch.int64) + base).remainder(256).to(torch.uint8)
