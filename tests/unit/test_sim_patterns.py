"""The simulator's metadata row pattern: every byte a function of (room,
field, byte) alone, the first output id the room's, and a row that differs
by one byte named by field and byte."""

import numpy as np
import pytest
import torch

from buffers import MetadataBuffers
from lifecycle.core.fingerprint import mix64
from pdlife.cluster.config import SIM_LAYOUT
from pdlife.sim.kv_bytes import _write_row, row_difference, row_pattern, row_size


def field_bytes(room: int, field: int, n: int) -> np.ndarray:
    """Field ``field``'s ``n`` bytes of ``room``, one field on its own."""
    words = np.arange(-(-n // 8), dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = mix64(
            np.array([room], np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(field + 1) * np.uint64(0xC2B2AE3D27D4EB4F)
        )
        vals = mix64(key[:, None] + words * np.uint64(0x9E3779B97F4A7C15))
    return vals.view(np.uint8).reshape(-1)[:n]


@pytest.mark.parametrize("room", [0, 1, 49_999, 50_000, 2**62 + 7, 2**64 - 1])
def test_each_field_is_its_own_stream_and_the_first_id_is_the_rooms(room):
    meta = MetadataBuffers(2, SIM_LAYOUT)
    got = dict(row_pattern(meta, room))
    fields = [(i, s) for i, s in enumerate(SIM_LAYOUT.fields) if s.name != "bootstrap_room"]
    assert list(got) == [s.name for _, s in fields]
    for i, spec in fields:
        want = field_bytes(room, i, spec.row_bytes).copy()
        if spec.name == "output_ids":
            want[:4] = np.array([room % 50000], dtype="<i4").view(np.uint8)
        assert np.array_equal(got[spec.name], want), spec.name
    assert row_size(meta) == sum(b.nbytes for b in got.values())


def test_a_row_one_byte_off_is_named_by_field_and_byte():
    meta = MetadataBuffers(2, SIM_LAYOUT)
    _write_row(meta, 1, 1234, 1234)
    assert row_difference(meta, 1, 1234) is None
    assert row_difference(meta, 1, 1235) is not None  # another request's row
    name, b = row_pattern(meta, 1234)[3]
    raw = meta.tensors[name][1].view(torch.uint8).numpy()
    raw[5] ^= 0xFF
    assert row_difference(meta, 1, 1234) == (
        f"metadata field {name} byte 5: holds {raw[5]}, expected {b[5]}"
    )
