"""A word of an older attempt is never applied to a newer one.

Hypothesis drives one room's attempts the way a retrying scheduler and a
slow peer would: attempts start (each at the next epoch, possibly while the
previous one still drains), are released, and words about any attempt so
far arrive in any order, early or late. Every word :class:`Attempts` delivers
must reach the attempt it names; an older attempt's word after that attempt
is gone is refused and counted.

Negative control: the same histories, with epochs switched off (every word
names epoch 0, as before epochs existed: one live request per room, keyed by
room) deliver some older attempt's completion to a newer attempt."""

from hypothesis import find, given, settings
from hypothesis import strategies as st

from transport.attempts import Attempts, Route

ROOM = 7
events = st.lists(
    st.one_of(
        st.just(("start",)),
        st.just(("release_old",)),
        st.just(("release_new",)),
        st.tuples(st.just("word"), st.integers(0, 5)),
    ),
    max_size=40,
)


def replay(history, epochs_on=True):
    """Run ``history``; returns the (named attempt, attempt that got it) pairs."""
    att = Attempts()
    live, next_epoch, got = [], 0, []

    def deliver(msg):
        route, req, _ = att.route(msg["room"], msg["epoch"], msg)
        if route is Route.DELIVER:
            got.append((msg["named"], req))

    for ev in history:
        if ev[0] == "start":
            if live and not epochs_on:
                continue  # one live request per room without epochs
            epoch = next_epoch if epochs_on else 0
            for msg in att.add(ROOM, epoch, next_epoch):  # the request: its true attempt
                got.append((msg["named"], next_epoch))
            live.append(next_epoch)
            next_epoch += 1
        elif ev[0].startswith("release") and live:
            a = live.pop(0 if ev[0] == "release_old" else -1)
            att.release(ROOM, a if epochs_on else 0, 1)
        elif ev[0] == "word" and next_epoch:
            named = ev[1] % next_epoch  # a word about some attempt started so far
            deliver({"kind": "done", "room": ROOM, "epoch": named if epochs_on else 0,
                     "named": named})  # fmt: skip
    return got, att


def crossed(history, epochs_on=True):
    got, _ = replay(history, epochs_on)
    return [(named, to) for named, to in got if named != to]


@given(events)
def test_every_word_reaches_the_attempt_it_names_or_none(history):
    assert crossed(history) == []


@given(events)
def test_words_of_gone_attempts_are_counted(history):
    got, att = replay(history)
    words = sum(1 for ev in history if ev[0] == "word")
    assert att.stale <= words
    assert len(got) + att.stale + sum(len(v) for v in att.early.values()) <= words


def test_negative_control_without_epochs_an_old_completion_reaches_a_new_attempt():
    seeded = settings(database=None, derandomize=True, max_examples=2000)
    bad = find(events, lambda h: crossed(h, epochs_on=False) != [], settings=seeded)
    assert any(named < to for named, to in crossed(bad, epochs_on=False))
