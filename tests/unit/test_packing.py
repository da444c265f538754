import numpy as np
import pytest

from lifecycle.core.fingerprint import fingerprint
from lifecycle.core.packing import HEADER, PAD, Field, Header, pack, unpack, write_field


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


def test_a_header_encoded_in_one_call_equals_one_written_field_by_field():
    from lifecycle.core.packing import encode_header, field_slice

    values = {
        Field.FINGERPRINT: 0xDEADBEEF12345678,
        Field.LENGTH: 4097,
        Field.CONFIG: 2**64 - 3,
        Field.QUEUE: 17,
        Field.TAG: 0,
        Field.NEED: 300,
        Field.FLOOR: 2**40,
    }
    for failer in (None, 0, 5, 2**24 - 1):
        b = np.zeros(HEADER, dtype=np.uint8)
        for f, v in values.items():
            write_field(b, f, v)
        if failer is None:
            b[field_slice(Field.FAILER)] = 255
        else:
            write_field(b, Field.FAILER, failer)
        got = encode_header(*values.values(), failer)
        assert got == b.tobytes()
        assert Header(np.frombuffer(got, dtype=np.uint8)).sole == failer


def test_failure_slots_name_each_writer_and_refuse_what_they_cannot_say():
    from lifecycle.core.packing import REGIONS, slot_origins, slots_size, write_slots

    cap = 256  # two entries per region
    blank = np.full(slots_size(cap), PAD, dtype=np.uint8)

    def reduced(*writers):
        out = blank.copy()
        for rank, pos, words in writers:
            area = blank.copy()
            write_slots(area, rank, np.array(pos, dtype=np.int64), np.array(words, np.uint8))
            np.minimum(out, area, out=out)
        return out

    failed = np.array([3, 7, 9])
    agreed = np.array([2, 5, 2], dtype=np.uint8)  # the winning words (reasons)
    # rank 4 failed 3 and 9 with the winning word, rank 1 failed 7; rank 2 failed 3
    # with another reason (its word lost): the origin is the lowest winner
    area = reduced((4, [3, 9], [2, 2]), (1, [7], [5]), (2, [3], [6]))
    assert slot_origins(area, failed, agreed).tolist() == [4, 1, 4]
    area = reduced((4, [3, 9], [2, 2]), (1, [3, 7], [2, 5]))
    assert slot_origins(area, failed, agreed).tolist() == [1, 1, 4]
    # a list longer than its region: only the count is there
    assert slot_origins(reduced((4, [3, 7, 9], [2, 5, 2])), failed, agreed) is None
    # two writers in one region (ranks REGIONS apart)
    both = reduced((1, [7], [5]), (1 + REGIONS, [3, 9], [2, 2]))
    assert slot_origins(both, failed, agreed) is None
    # an entry naming a row that did not fail, or a failed row nobody listed
    assert slot_origins(reduced((4, [4], [2])), failed, agreed) is None
    assert slot_origins(reduced((4, [3, 9], [2, 2])), failed, agreed) is None
    # a region whose owner cannot be a rank
    bad = reduced((4, [3, 9], [2, 2]), (1, [7], [5]))
    bad.view(">u4").reshape(REGIONS, -1)[4, :2] = [0x80000000, 0x7FFFFFFF]
    assert slot_origins(bad, failed, agreed) is None
    assert slot_origins(blank, failed[:0], agreed[:0]).tolist() == []


@pytest.mark.parametrize("states", [[3] * 40, [0] * 7, [1, 2, 3, 4, 0] * 9, [4], []])
def test_list_sum_is_the_weighted_sum_of_keys_and_statuses(states):
    """One status for every row takes a shortcut; the sum is the same."""
    from lifecycle.core.fingerprint import list_sum, position_weights, room_keys

    n = len(states)
    keys = room_keys(np.arange(100, 100 + n, dtype=np.uint64))
    st = np.array(states, dtype=np.int8)
    w = position_weights(n)
    want = sum((int(k) + s) * int(x) for k, s, x in zip(keys, states, w)) % 2**64
    assert list_sum(keys.copy(), st) == want


@pytest.mark.parametrize("per_rank", [3, 20, 60])
def test_failure_slots_read_alike_for_few_and_many_entries(per_rank):
    """Few listed entries are read in Python integers, many in one numpy pass:
    both give each failed row the lowest rank whose word won."""
    from lifecycle.core.packing import slot_origins, slots_size, write_slots

    cap = 8192  # 64 entries per region
    rng = np.random.default_rng(per_rank)
    blank = np.full(slots_size(cap), PAD, dtype=np.uint8)
    for _ in range(20):
        ranks = rng.choice(8, size=int(rng.integers(2, 9)), replace=False).tolist()
        rows = np.sort(rng.choice(cap, size=per_rank * 4, replace=False))
        out = blank.copy()
        lists = {}
        for r in ranks:
            pos = np.sort(rng.choice(rows, size=per_rank, replace=False))
            words = rng.integers(0, 11, size=per_rank).astype(np.uint8)
            lists[r] = dict(zip(pos.tolist(), words.tolist()))
            area = blank.copy()
            write_slots(area, r, pos, words)
            np.minimum(out, area, out=out)
        failed = np.array(sorted(set().union(*lists.values())), dtype=np.int64)
        agreed = np.array(
            [min(w[p] for w in lists.values() if p in w) for p in failed.tolist()], np.uint8
        )
        want = [
            min(r for r, w in lists.items() if w.get(p) == a)
            for p, a in zip(failed.tolist(), agreed.tolist())
        ]
        assert slot_origins(out, failed, agreed).tolist() == want
        # a failed row no rank listed: the slots cannot say
        extra = np.setdiff1d(np.arange(cap), failed)[:1]
        more = np.sort(np.concatenate([failed, extra]))
        more_agreed = agreed[np.searchsorted(failed, more).clip(0, failed.size - 1)]
        assert slot_origins(out, more, more_agreed) is None


@pytest.mark.parametrize("name", ["_position_keys", "position_weights"])
def test_a_cached_table_grown_by_two_threads_at_once_answers_both_in_full(monkeypatch, name):
    """Steps prepare on several threads (simulated ranks, group workers): a
    thread that grows the cache must not hand back another thread's smaller
    table. Forced interleaving: B sizes a table from the empty cache and
    pauses; A grows a larger one and pauses at its return; B stores its own
    (smaller) table; A returns."""
    import inspect
    import sys
    import threading

    from lifecycle.core import fingerprint as packing  # where the caches live

    fn = getattr(packing, name)
    grow = packing._cached  # the cache both answer from
    lines, first = inspect.getsourcelines(grow)
    ret = first + max(i for i, line in enumerate(lines) if "return" in line)
    monkeypatch.setattr(packing, "_TABLES", {})
    b_in_mix, a_at_return, b_done = threading.Event(), threading.Event(), threading.Event()
    mix = packing._mix
    b_thread: list[threading.Thread] = []

    def paused_mix(x):
        if threading.current_thread() in b_thread:
            b_in_mix.set()
            a_at_return.wait(5)
        return mix(x)

    monkeypatch.setattr(packing, "_mix", paused_mix)

    def tracer(frame, event, arg):
        if frame.f_code is not grow.__code__:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == ret:
                a_at_return.set()
                b_done.wait(5)
            return local

        return local

    got = {}

    def b():
        got["b"] = fn(2000).size
        b_done.set()

    def a():
        b_in_mix.wait(5)
        sys.settrace(tracer)
        try:
            got["a"] = fn(5000).size
        finally:
            sys.settrace(None)

    b_thread.append(threading.Thread(target=b))
    ta = threading.Thread(target=a)
    for t in (*b_thread, ta):
        t.start()
    for t in (*b_thread, ta):
        t.join(10)
    assert got == {"a": 5000, "b": 2000}
    assert fn(5000).size == 5000
