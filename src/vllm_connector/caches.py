"""vLLM's KV caches as this library's :class:`~buffers.kv_args.KVArgs`.

vLLM hands a worker's connector its KV caches as one tensor per attention
layer (``register_kv_caches``), in the model's layer order, the same on
prefill and decode. Two layouts are moved:

- ``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys and values
  apart (the layout of vLLM's FlashAttention and CPU backends); each layer
  gives two buffers, keys then values, each of pages ``(block_size,
  num_kv_heads, head_size)``, token-major, so TP sizes that differ cut pages
  into head slices;
- ``(num_blocks, block_size, head_size)``: one latent per token (MLA): one
  buffer per layer.

Anything else is refused naming the layer and its shape. Every layer must
hold the same blocks of the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from buffers.kv_args import KVArgs
from transport.errors import ConfigError
from transport.layout import kv_args_for

__all__ = ["CacheShape", "kv_args_of"]


class CacheShape:
    """What the layers' caches say about the model: pages, tokens per page, heads."""

    def __init__(self, blocks: int, block_size: int, kv_heads: int, mla: bool) -> None:
        self.blocks, self.block_size, self.kv_heads, self.mla = blocks, block_size, kv_heads, mla


def _split(name: str, t: Any) -> tuple[list[torch.Tensor], CacheShape]:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"kv_caches[{name!r}]", t, "a tensor", "register_kv_caches")
    if not t.is_contiguous():
        raise ConfigError(
            f"kv_caches[{name!r}]", tuple(t.shape), "a contiguous tensor", "register_kv_caches"
        )
    if t.dim() == 5 and t.shape[0] == 2:
        _, blocks, size, heads, _ = t.shape
        return [t[0], t[1]], CacheShape(blocks, size, heads, mla=False)
    if t.dim() == 3:
        blocks, size, _ = t.shape
        return [t], CacheShape(blocks, size, 1, mla=True)
    raise ConfigError(
        f"kv_caches[{name!r}].shape",
        tuple(t.shape),
        "(2, num_blocks, block_size, num_kv_heads, head_size) or, for MLA, (num_blocks, "
        "block_size, head_size)",
        "register_kv_caches",
    )


def kv_args_of(kv_caches: Mapping[str, Any], engine_rank: int) -> tuple[KVArgs, CacheShape]:
    """The KVArgs of every layer's cache (keys then values per layer, in the
    order vLLM gave the layers) and their common shape."""
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise ConfigError("kv_caches", kv_caches, "a non-empty dict of layer name -> tensor")
    tensors: list[torch.Tensor] = []
    shape: CacheShape | None = None
    for name, t in kv_caches.items():
        parts, s = _split(name, t)
        if shape is not None and vars(s) != vars(shape):
            raise ConfigError(
                f"kv_caches[{name!r}].shape",
                tuple(t.shape),
                f"the first layer's blocks, block size and heads ({vars(shape)})",
                "register_kv_caches",
            )
        shape = s
        tensors += parts
    assert shape is not None
    args = kv_args_for(
        tensors, ([], [], []), engine_rank, page_size=shape.block_size, kv_head_num=shape.kv_heads
    )
    return args, shape
