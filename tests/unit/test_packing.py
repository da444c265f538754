import numpy as np

from lifecycle.packing import HEADER, Header, fingerprint, pack, unpack, write_header


def test_pack_unpack_roundtrip():
    status = np.array([0, 1, 2, 3, 4], dtype=np.int8)
    reason = np.array([3, 15, 15, 15, 15], dtype=np.int8)
    out = np.empty(5, dtype=np.int32)
    pack(status, reason, 1234, out)
    s, r, o = unpack(out)
    assert s.tolist() == status.tolist()
    assert r.tolist() == reason.tolist()
    assert o.tolist() == [1234] * 5
    assert (out >= 0).all()


def test_min_picks_status_then_reason_then_rank():
    words = []
    for status, reason, rank in [(0, 5, 1), (0, 2, 3), (4, 15, 0), (0, 2, 2)]:
        w = np.empty(1, dtype=np.int32)
        pack(np.array([status]), np.array([reason]), rank, w)
        words.append(w)
    s, r, o = unpack(np.minimum.reduce(words))
    assert (s[0], r[0], o[0]) == (0, 2, 2)


def test_fingerprint_is_order_and_length_sensitive():
    a = np.array([1, 2, 3], dtype=np.uint64)
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(a[::-1].copy())
    assert fingerprint(a) != fingerprint(a[:2])
    assert fingerprint(np.empty(0, dtype=np.uint64)) != fingerprint(np.array([0], np.uint64))
    assert 0 <= fingerprint(a) < 2**62


def test_header_min_max():
    bufs = []
    for n, fp in [(3, 2**61 + 5), (4, 7)]:
        b = np.zeros(HEADER, dtype=np.int32)
        write_header(b, n, fp)
        bufs.append(b)
    h = Header(np.minimum.reduce(bufs))
    assert (h.len_min, h.len_max) == (3, 4)
    assert not h.agreed
    same = Header(np.minimum.reduce([bufs[0], bufs[0].copy()]))
    assert same.agreed
    assert same.fp_min == 2**61 + 5
