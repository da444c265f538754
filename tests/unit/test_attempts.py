"""transport.attempts: a room's attempts by epoch, and where each word goes."""

from transport.attempts import Attempts, Route


def word(epoch, kind="done", room=7):
    return {"kind": kind, "room": room, "epoch": epoch}


def route(a, w):
    return a.route(w["room"], w["epoch"], w)


def test_releasing_the_newer_attempt_leaves_the_older_live_and_both_taken():
    a = Attempts()
    a.add(7, 0, "a0")
    a.add(7, 1, "a1")  # the first still drains
    a.release(7, 1, 5)
    assert a.live(7) == "a0" and a.taken(7, 0) and a.taken(7, 1) and not a.taken(7, 2)
    assert route(a, word(0)) == (Route.DELIVER, "a0", 0)
    assert route(a, word(1)) == (Route.LATE, None, 5)  # the released one's late word: answered
    a.release(7, 0, 5)
    assert a.live(7) is None and a.older == {} and not a.taken(7, 0)  # the room may start over


def test_an_older_attempt_released_first_leaves_the_newer_one():
    a = Attempts()
    a.add(3, 0, "x")
    a.add(3, 1, "y")
    a.release(3, 0, 1)
    assert a.live(3) == "y" and a.older == {} and 3 not in a.cleared
    assert route(a, word(0, room=3))[0] is Route.STALE and a.stale == 1


def test_words_ahead_wait_for_their_attempt_and_older_ones_are_dropped():
    a = Attempts()
    assert route(a, word(1))[0] is Route.EARLY and route(a, word(0))[0] is Route.EARLY
    assert a.add(7, 1, "r1") == [word(1)]  # its own word now; the older one refused
    assert a.stale == 1 and a.early == {}
