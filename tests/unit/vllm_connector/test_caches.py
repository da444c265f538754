"""vLLM's per-layer KV caches as KVArgs: keys and values apart, pages of
block_size tokens; a layout this connector cannot move is refused by layer."""

import pytest
import torch

from transport.errors import ConfigError
from vllm_connector.caches import kv_args_of


def layer(blocks=6, size=4, heads=2, dim=8, dtype=torch.bfloat16):
    return torch.zeros((2, blocks, size, heads, dim), dtype=dtype)


def test_each_layer_gives_its_keys_then_values():
    caches = {"layers.0": layer(), "layers.1": layer()}
    args, shape = kv_args_of(caches, engine_rank=3)
    k0, v0 = caches["layers.0"][0], caches["layers.0"][1]
    assert args.kv_data_ptrs[:2] == (k0.data_ptr(), v0.data_ptr())
    assert args.kv_data_ptrs[2] == caches["layers.1"][0].data_ptr()
    assert args.kv_item_lens == (4 * 2 * 8 * 2,) * 4  # a block: tokens x heads x dim x 2 bytes
    assert args.kv_data_lens == (6 * 4 * 2 * 8 * 2,) * 4
    assert (args.engine_rank, args.page_size, args.kv_head_num) == (3, 4, 2)
    assert (shape.blocks, shape.block_size, shape.kv_heads, shape.mla) == (6, 4, 2, False)


def test_mla_latents_are_one_buffer_per_layer():
    args, shape = kv_args_of({"l0": torch.zeros((5, 16, 64))}, 0)
    assert len(args.kv_data_ptrs) == 1 and shape.mla and args.kv_item_lens == (16 * 64 * 4,)


@pytest.mark.parametrize(
    ("caches", "named"),
    [
        ({}, "kv_caches"),
        ({"l0": "tensor"}, "kv_caches['l0']"),
        ({"l0": torch.zeros((6, 2, 4, 2, 8))}, "kv_caches['l0'].shape"),  # blocks first
        ({"l0": layer(), "l1": layer(blocks=7)}, "kv_caches['l1'].shape"),
        ({"l0": layer().transpose(1, 2)}, "kv_caches['l0']"),  # not contiguous
    ],
)
def test_a_layout_that_cannot_be_moved_is_refused_by_layer(caches, named):
    with pytest.raises(ConfigError) as e:
        kv_args_of(caches, 0)
    assert named in str(e.value)
