"""transport.connector.core.messages: every word a typed value, read back whole or refused."""

import json

import numpy as np
import pytest

from lifecycle.reasons import FailureReason
from transport.connector.core.messages import (
    MESSAGES,
    Abort,
    Done,
    Incoming,
    Landed,
    Pages,
    Register,
    Stopped,
    parse,
)
from transport.connector.core.wire import CHECKS, MalformedMessage
from transport.digest import LegDigest

EXAMPLES = [
    Register(
        5,
        1,
        decode_tp=2,
        dp=0,
        kv_heads=8,
        mla=False,
        slice=(0, 4, 4),
        head_group=2,
        state=[[[[1, 2]], [[3, 4]]]],
        state_leg=True,
        digest=True,
    ),
    Pages(5, 1, np.array([3, 9, 4]), 2, 1, 8, None, [np.array([7]), np.array([8, 9])]),
    Pages(6, 0, np.empty(0, dtype=np.int64), -1, 0, 0),
    Abort(5, 1, FailureReason.CHECKSUM_MISMATCH, "bytes differ"),
    Done.of(5, 1, LegDigest(123, 456, 789)),
    Done(5, 1),
    Landed(5, 1, (0, 4)),
    Stopped(5, 1),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_crosses_the_wire_unchanged(msg):
    raw = json.loads(json.dumps({**msg.to_wire(), "from": 3, "inc": 11}))
    got = parse(raw)
    assert got == Incoming(3, 11, msg)
    assert got.room == msg.room and got.epoch == msg.epoch
    assert raw["kind"] == str(msg.KIND)


def test_every_word_has_a_class_and_every_field_a_declared_check():
    for word, decl in MESSAGES.items():
        assert decl.type.KIND is word
    assert "Ints" in CHECKS and "FailureReason" in CHECKS


def test_the_digest_rides_with_done():
    d = LegDigest(1, 2, 3)
    assert Done.of(9, 0, d).leg_digest() == d
    assert Done(9, 0).leg_digest() is None


def test_an_older_peer_that_names_no_epoch_means_the_first_attempt():
    assert parse({"kind": "done", "room": 8, "from": 0}).msg == Done(8, 0)


#: a page list that parses; each case below spoils one field of it
PAGES = {"kind": "pages", "room": 7, "from": 0, "pages": [1], "slot": 1, "skip": 0, "dst_heads": 2}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"kind": "explode", "room": 1, "from": 0}, "kind"),
        ({"room": 1, "from": 0}, "kind"),
        ([1, 2], "body"),
        ({"kind": "done", "room": 1}, "from"),
        ({"kind": "done", "room": 1, "from": -2}, "from"),
        ({"kind": "done", "room": 1, "from": "0"}, "from"),
        ({"kind": "done", "room": 1, "from": 0, "inc": "x"}, "inc"),
        ({"kind": "done", "from": 0}, "room"),
        ({"kind": "done", "room": "7", "from": 0}, "room"),
        ({"kind": "done", "room": 7, "from": 0, "epoch": -1}, "epoch"),
        ({"kind": "done", "room": 7, "from": 0, "epoch": "1"}, "epoch"),
        ({"kind": "done", "room": 7, "from": 0, "epoch": None}, "epoch"),
        ({"kind": "done", "room": 7, "from": 0, "epoch": 1.5}, "epoch"),
        ({"kind": "done", "room": 7, "from": 0, "epoch": True}, "epoch"),
        ({"kind": "failed", "room": 7, "from": 0, "reason": 99}, "reason"),
        ({"kind": "abort", "room": 7, "from": 0, "why": 3}, "why"),
        ({"kind": "pages", "room": 7, "from": 0, "slot": 1, "skip": 0, "dst_heads": 2}, "pages"),
        ({**PAGES, "pages": [1.5]}, "pages"),
        ({**PAGES, "pages": [[1]]}, "pages"),
        ({**PAGES, "slot": True}, "slot"),
        (
            {
                "kind": "register",
                "room": 7,
                "from": 0,
                "decode_tp": 1,
                "dp": 0,
                "kv_heads": 2,
                "mla": False,
                "slice": [0, 1],
            },
            "slice",
        ),
        ({"kind": "register", "room": 7, "from": 0, "dp": 0, "kv_heads": 2, "mla": 0}, "decode_tp"),
        ({"kind": "landed", "room": 7, "from": 0, "span": [3]}, "span"),
    ],
)
def test_a_message_that_does_not_parse_is_refused_naming_the_field(raw, field):
    with pytest.raises(MalformedMessage, match="want") as err:
        parse(raw)
    assert err.value.field == field
