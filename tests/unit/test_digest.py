"""The KV digest of a leg's bytes (transport.digest): equal bytes give equal
digests whichever way they are gathered, one flipped byte or another page
order does not, and the signature names what a digest covers."""

import numpy as np
import pytest

from buffers.kv_args import KVArgs
from transport import digest as dg

ALGOS = ["crc32"] + (["xxh3_64"] if dg.ALGORITHM == "xxh3_64" else [])


def _kv(pages=8, ps=4, heads=4, hb=8, heads_major=False, seed=0):
    """A KV buffer of random bytes and the KVArgs naming it (with a 3-field row)."""
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, pages * ps * heads * hb, dtype=np.uint8)
    aux = [rng.integers(0, 256, 4 * n, dtype=np.uint8) for n in (16, 8, 8)]
    args = KVArgs(
        page_size=ps,
        kv_head_num=heads,
        heads_major=heads_major,
        engine_rank=0,
        kv_data_ptrs=[buf.ctypes.data],
        kv_data_lens=[buf.nbytes],
        kv_item_lens=[ps * heads * hb],
        aux_data_ptrs=[a.ctypes.data for a in aux],
        aux_data_lens=[a.nbytes for a in aux],
        aux_item_lens=[a.nbytes // 4 for a in aux],
    )
    return buf, aux, args


@pytest.mark.parametrize("algo", ALGOS)
def test_equal_bytes_give_equal_digests_however_they_are_gathered(algo):
    buf, _, args = _kv()
    v = dg.Views(args)
    pages = np.array([1, 2, 3], dtype=np.int64)
    whole = dg.digest(v.kv_parts(pages, 0, 4), algo)
    # the same bytes as one contiguous slice, hashed in one call
    flat = buf.reshape(8, -1)[1:4].reshape(1, -1)
    one = dg.digest([(flat, np.zeros(1, np.int64), (slice(None),))], algo)
    assert whole == one
    assert whole[1] == 3 * buf.nbytes // 8
    # runs hashed in place and rows gathered give the same digest
    scattered = np.array([6, 0, 3], dtype=np.int64)
    gathered = np.ascontiguousarray(buf.reshape(8, -1)[scattered]).reshape(1, -1)
    want = dg.digest([(gathered, np.zeros(1, np.int64), (slice(None),))], algo)
    assert dg.digest(v.kv_parts(scattered, 0, 4), algo) == want


@pytest.mark.parametrize("heads_major", [False, True])
def test_a_head_slice_is_the_bytes_the_writes_carry(heads_major):
    """Heads [1, 3) of each page, in the order a head-sliced write carries them."""
    buf, _, args = _kv(heads_major=heads_major)
    v = dg.Views(args)
    pages = np.array([5, 2], dtype=np.int64)
    shaped = buf.reshape((8, 4, 4, 8))  # (page, token, head, byte) or (page, head, token, byte)
    want = np.concatenate(
        [(shaped[p, 1:3] if heads_major else shaped[p, :, 1:3]).reshape(-1) for p in pages]
    )
    got = dg.digest(v.kv_parts(pages, 1, 2))
    assert got == dg.digest([(want.reshape(1, -1), np.zeros(1, np.int64), (slice(None),))])


@pytest.mark.parametrize("algo", ALGOS)
def test_one_flipped_byte_or_another_page_order_differs(algo):
    buf, _, args = _kv()
    v = dg.Views(args)
    pages = np.array([0, 1, 2, 3], dtype=np.int64)
    before = dg.digest(v.kv_parts(pages, 0, 4), algo)
    assert dg.digest(v.kv_parts(pages[::-1].copy(), 0, 4), algo) != before
    assert dg.flip(v.kv_parts(pages, 1, 2), offset=5)  # one byte of head 1 of page 0
    after = dg.digest(v.kv_parts(pages, 0, 4), algo)
    assert after != before and after[1] == before[1]
    assert np.count_nonzero(buf != _kv()[0]) == 1  # exactly one byte changed, in place
    dg.flip(v.kv_parts(pages, 1, 2), offset=5)
    assert dg.digest(v.kv_parts(pages, 0, 4), algo) == before


def test_nothing_to_hash_is_a_digest_of_no_bytes_and_flips_nothing():
    _, _, args = _kv()
    v = dg.Views(args)
    none = np.empty(0, dtype=np.int64)
    empty = dg.digest(v.kv_parts(none, 0, 4))
    assert empty == dg.digest([]) and empty[1] == 0
    assert not dg.flip(v.kv_parts(none, 0, 4))
    assert dg.leg_parts(v, none, (0, 4), -1, None, ([], None, True)) == []


def test_the_metadata_row_is_every_field_room_column_last():
    _, aux, args = _kv()
    v = dg.Views(args)
    parts = v.row_parts(2)
    assert [p[0].shape[1] for p in parts] == [16, 8, 8]
    before = dg.digest(parts)
    aux[2][2 * 8] ^= 1  # the room column of row 2
    assert dg.digest(parts) != before
    aux[2][2 * 8] ^= 1
    aux[0][0] ^= 1  # another row: not covered
    assert dg.digest(parts) == before


def test_the_signature_names_the_hash_and_the_shape_of_every_part():
    _, _, args = _kv()
    v = dg.Views(args)
    pages = np.array([0, 1], dtype=np.int64)
    sig = dg.signature(v.kv_parts(pages, 0, 4))
    assert 0 < sig < 2**63 and sig & 1 and sig != dg.NO_DIGEST
    assert dg.signature(v.kv_parts(pages, 0, 4)) == sig
    assert dg.signature(v.kv_parts(pages, 0, 2)) != sig  # another head slice
    assert dg.signature(v.kv_parts(pages[:1], 0, 4)) != sig  # another page count
    assert dg.signature(v.kv_parts(pages, 0, 4), "crc32" if dg.ALGORITHM != "crc32" else "x") != sig


def test_a_done_without_a_digest_carries_none():
    d = dg.LegDigest(123, 7, 64)
    assert dg.LegDigest.from_msg({"kind": "done", **d.to_msg()}) == d
    assert dg.LegDigest.from_msg({"kind": "done"}) is None
    assert dg.LegDigest.from_msg({"kind": "done", "digest": 1, "sig": 0}) is None


def test_an_unknown_hash_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown digest algorithm 'md4'"):
        dg.new_hasher("md4")
    assert dg.measure(1 << 16, "crc32", reps=1) > 0


@pytest.mark.parametrize("algo", ALGOS)
def test_pieces_cut_across_rows_and_parts_give_one_digest_however_the_rows_lie(algo, monkeypatch):
    """The stream is cut every PIECE bytes wherever rows and parts break; the
    same bytes in place, gathered or as one flat row give one digest."""
    from transport.digest import hashing

    monkeypatch.setattr(hashing, "PIECE", 100)  # many pieces, each crossing a row edge
    buf, aux, args = _kv()
    v = dg.Views(args)
    pages = np.array([6, 0, 3, 4], dtype=np.int64)
    parts = v.kv_parts(pages, 0, 4) + v.row_parts(1)
    flat = np.concatenate(
        [buf.reshape(8, -1)[pages].reshape(-1)] + [a.reshape(4, -1)[1] for a in aux]
    )
    got = dg.digest(parts, algo)
    assert got == dg.digest([(flat.reshape(1, -1), np.zeros(1, np.int64), (slice(None),))], algo)
    assert got[1] == flat.size
    monkeypatch.setattr(hashing, "PIECE", 1 << 22)
    assert dg.digest(parts, algo)[0] != got[0]  # another cut: another digest (both sides cut alike)


def test_the_hashing_threads_give_the_digest_of_the_calling_thread(monkeypatch):
    from transport.digest import hashing

    monkeypatch.setattr(hashing, "PIECE", 64)
    monkeypatch.setattr(hashing, "_INLINE", 0)  # every stream on the threads
    buf, _, args = _kv(pages=64)
    v = dg.Views(args, threads=3)
    pages = np.random.default_rng(1).permutation(64).astype(np.int64)
    parts = v.kv_parts(pages, 1, 2)
    pending = [v.start(parts) for _ in range(4)]  # several at once share the threads
    want = dg.LegDigest.of(parts)
    assert all(p.result() == want for p in pending)
    assert v._pool is not None and len(pending[0].futures) > 1
    buf[int(pages[0]) * buf.size // 64 + 20] ^= 1  # a byte of head 1 of the first page
    assert v.start(parts).result() != want  # (a negative control)
    v.close()
    assert v._pool is None
    buf[int(pages[0]) * buf.size // 64 + 20] ^= 1
    assert v.start(parts).result() == want  # after close: hashed on the caller's thread
    assert v._pool is None


def test_progress_hashes_a_piece_only_once_every_page_it_covers_is_in(monkeypatch):
    """Pieces of the paged parts start as their pages land (in any order);
    bytes changed on pages not yet in are hashed as they end up, and the
    digest is the one of the final bytes."""
    from transport.digest import hashing

    monkeypatch.setattr(hashing, "PIECE", 96)  # a page is 128 bytes: pieces cross pages
    monkeypatch.setattr(hashing, "_INLINE", 0)
    buf, _, args = _kv()
    v = dg.Views(args)
    pages = np.array([5, 1, 6, 2], dtype=np.int64)
    parts = v.kv_parts(pages, 0, 4) + v.row_parts(0)
    prog = dg.Progress(v, parts, paged=1)
    assert prog.needs[-1] == float("inf")  # the row's piece: only at the end
    prog.landed(2, 3)  # not a prefix yet: nothing starts
    assert prog.prefix == 0 and not any(prog.futures)
    prog.landed(0, 2)
    assert prog.prefix == 3
    started = [f is not None for f in prog.futures]
    assert started == [n <= 3 for n in prog.needs] and any(started) and not all(started)
    buf.reshape(8, -1)[2, 5] ^= 0xFF  # request page 3 (buffer page 2): not in yet
    prog.landed(3, 4)
    got = prog.finish().result()
    assert got == dg.LegDigest.of(parts)  # the final bytes
    buf.reshape(8, -1)[2, 5] ^= 0xFF
    assert got != dg.LegDigest.of(parts)  # (the control: that byte is covered)
    v.close()
