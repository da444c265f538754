import numpy as np
import pytest

from lifecycle.packing import HEADER, PAD, Field, Header, fingerprint, pack, unpack, write_field


def test_pack_unpack_roundtrip():
    status = np.array([0, 1, 2, 3, 4], dtype=np.int8)
    reason = np.array([3, 15, 15, 15, 15], dtype=np.int8)
    out = np.empty(5, dtype=np.uint8)
    pack(status, reason, out)
    s, r = unpack(out)
    assert s.tolist() == status.tolist()
    assert r.tolist() == reason.tolist()
    assert (out < PAD).all()


def test_min_picks_status_then_reason():
    words = []
    for status, reason in [(0, 5), (0, 2), (4, 15), (0, 3)]:
        w = np.empty(1, dtype=np.uint8)
        pack(np.array([status]), np.array([reason]), w)
        words.append(w)
    s, r = unpack(np.minimum.reduce(words))
    assert (s[0], r[0]) == (0, 2)


def test_fingerprint_is_order_and_length_sensitive():
    a = np.array([1, 2, 3], dtype=np.uint64)
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(a[::-1].copy())
    assert fingerprint(a) != fingerprint(a[:2])
    assert fingerprint(np.empty(0, dtype=np.uint64)) != fingerprint(np.array([0], np.uint64))
    assert 0 <= fingerprint(a) < 2**64


def _header(**fields):
    b = np.zeros(HEADER, dtype=np.uint8)
    for f in Field:
        write_field(b, f, fields.get(f.name, 0))
    return b


@pytest.mark.parametrize("field", ["FINGERPRINT", "CONFIG", "QUEUE", "TAG"])
def test_header_sees_min_and_max_of_matched_fields(field):
    a, b = _header(**{field: 2**61 + 5}), _header(**{field: 7})
    h = Header(np.minimum.reduce([a, b]))
    assert not h.agreed
    assert h.differing() == (Field[field],)
    lo, hi = h.bounds(Field[field])
    assert lo <= 7 and hi >= 2**61 + 5
    same = Header(np.minimum.reduce([a, a.copy()]))
    assert same.agreed and same.bounds(Field[field]) == (2**61 + 5, 2**61 + 5)


def test_capacity_fields_give_an_upper_bound_on_every_rank():
    values = [0x00FF, 0x0100, 3]
    h = Header(np.minimum.reduce([_header(NEED=v, FLOOR=v) for v in values]))
    assert h.agreed  # bounds are not matched fields
    assert h.need >= max(values) and h.floor >= max(values)
