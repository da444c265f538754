"""lifecycle.drive.lent: what is lent to a backend is held while it holds it."""

import gc

import pytest

from lifecycle.drive import lent
from lifecycle.drive.collective import _TorchWork


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with nothing lent and no holders (others' are put back)."""
    with lent._lock:
        saved = (list(lent._lent), list(lent._holders), list(lent._callbacks))
        lent._lent.clear(), lent._holders.clear(), lent._callbacks.clear()
        lent._incoming.clear()
    yield
    with lent._lock:
        lent._lent[:], lent._holders[:], lent._callbacks[:] = saved
        lent._incoming.clear()


class Lent:
    """A stand-in tensor: the backend lets go after ``held`` more looks."""

    def __init__(self, held: int) -> None:
        self.held = held

    def _use_count(self) -> int:
        if self.held > 0:
            self.held -= 1
            return 2
        return 1


class Holder:
    def __init__(self, *tensors) -> None:
        self.tensors = tensors
        lent.hold(self)

    def lent_tensors(self):
        return self.tensors


HELD = 10**9


def test_released_tensors_are_not_kept():
    lent.lend(Lent(0), object())  # released, and not a tensor: nothing to hold
    assert lent.outstanding() == []


def test_a_held_tensor_is_kept_until_the_backend_lets_go():
    t = Lent(HELD)
    lent.lend(t)
    assert lent.outstanding() == [t]
    assert lent.settle(timeout=0) == 1
    t.held = 3  # the backend lets go a few looks later
    assert lent.settle(timeout=5, poll=0) == 0
    assert lent.outstanding() == []


def test_holders_are_asked_and_weakly_referenced():
    t = Lent(HELD)
    h = Holder(t)
    assert lent.outstanding() == [t]
    del h
    gc.collect()
    assert lent.outstanding() == []


def test_lent_later_from_a_finalizer_is_taken_in_without_the_lock():
    t = Lent(HELD)
    with lent._lock:  # a collection inside outstanding() runs finalizers so
        lent.lend_later([t, None])
    assert lent.outstanding() == [t]
    t.held = 0
    assert lent.outstanding() == []


def test_a_callback_is_waited_for_until_the_backend_releases_it():
    ran = []
    cb = lent.Callback(lambda: ran.append(1))
    cb(None)
    assert ran == [1]
    assert lent.outstanding() == [cb]
    del cb  # what the backend's thread does once it is done with it
    gc.collect()
    assert lent.settle(timeout=0) == 0


def test_a_bounded_wait_gives_up_and_says_how_many():
    t = Lent(HELD)
    lent.lend(t)
    assert lent.settle(timeout=0.01, poll=0.001) == 1
    t.held = 0
    assert lent.settle(timeout=0) == 0


def test_at_exit_waits_at_most_exit_wait_and_says_what_is_left(monkeypatch, caplog):
    t = Lent(HELD)
    lent.lend(t)
    monkeypatch.setattr(lent, "EXIT_WAIT", 0.01)
    with caplog.at_level("DEBUG", logger="lifecycle.drive.lent"):
        lent._at_exit()
    assert "still holds 1 lent tensors" in caplog.text


def test_a_base_held_by_its_lent_views_is_let_go_with_them():
    views = [Lent(1), Lent(1)]  # held at the first look only

    class Base:
        def _use_count(self) -> int:  # each live view holds its base
            return 1 + sum(v in lent._lent for v in views)

    lent.lend(*views, Base())
    assert len(lent._lent) == 3
    assert lent.settle(timeout=1, poll=0) == 0


class _Work:
    """A backend's work handle: counts waits; its future runs callbacks at once."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1

    def get_future(self):
        class Future:
            def then(self, fn):
                fn(None)
                return self

            def done(self):
                return True

        return Future()


def test_a_waited_reduce_lets_go_of_the_backends_handle_and_waits_once():
    work = _Work()
    pending = _TorchWork(work, coll=None)
    pending.wait()
    pending.wait()
    assert work.waits == 1
    assert pending._work is None and pending._after is None
    ran = []
    pending.then(lambda: ran.append(1))  # landed already: runs at once
    assert ran == [1]


def test_then_before_wait_runs_on_the_backend_and_is_tracked():
    work = _Work()
    pending = _TorchWork(work, coll=None)
    ran = []
    pending.then(lambda: ran.append(1))
    assert ran == [1]
    pending.wait()
    assert work.waits == 1
