"""lifecycle.drive.lent: tensors lent to a backend are held while it holds them."""

import gc

from lifecycle.drive import lent


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


def test_released_tensors_are_not_kept():
    lent.settle(timeout=0)
    free = Lent(0)
    lent.lend(free, object())  # not a tensor: nothing to hold
    assert lent.outstanding() == []


def test_a_held_tensor_is_kept_until_the_backend_lets_go():
    t = Lent(10**9)
    lent.lend(t)
    assert lent.outstanding() == [t]
    assert lent.settle(timeout=0) == 1
    t.held = 3  # the backend lets go a few looks later
    assert lent.settle(timeout=5, poll=0) == 0
    assert lent.outstanding() == []


def test_holders_are_asked_and_weakly_referenced():
    t = Lent(10**9)
    h = Holder(t)
    assert t in lent.outstanding()
    del h
    gc.collect()
    assert t not in lent.outstanding()


def test_a_bounded_wait_gives_up_and_says_how_many():
    t = Lent(10**9)
    lent.lend(t)
    assert lent.settle(timeout=0.01, poll=0.001) == 1
    t.held = 0
    assert lent.settle(timeout=0) == 0


def test_at_exit_waits_at_most_exit_wait_and_says_what_is_left(monkeypatch, caplog):
    t = Lent(10**9)
    lent.lend(t)
    monkeypatch.setattr(lent, "EXIT_WAIT", 0.01)
    with caplog.at_level("DEBUG", logger="lifecycle.drive.lent"):
        lent._at_exit()
    assert "still holds 1 lent tensors" in caplog.text
    t.held = 0
    assert lent.settle(timeout=0) == 0


def test_a_base_held_by_its_lent_views_is_let_go_with_them():
    views = [Lent(1), Lent(1)]  # held at the first look only

    class Base:
        def _use_count(self) -> int:  # each live view holds its base
            return 1 + sum(v in lent._lent for v in views)

    base = Base()
    lent.lend(*views, base)
    assert len(lent._lent) == 3
    assert lent.settle(timeout=1, poll=0) == 0
