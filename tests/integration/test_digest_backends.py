"""The KV digest over the byte-moving backends (Mooncake over TCP, NIXL over
UCX) on 127.0.0.1: one prefill and one decode process, one request whose
committed bytes decode corrupts (Connector.corrupt) before its check. With the
digest on, decode fails it with a checksum mismatch and prefill hears so;
with it off (the negative control) the same corruption goes unseen."""

import pytest
from test_transfer_backends import _manager, _pair

from support.wait import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(180)]


def _corrupt_pair(backend, role, port, q, digest):
    import numpy as np
    import torch

    from lifecycle import KVPoll

    m, kv, meta = _manager(backend, role, port, f"digest{int(digest)}", digest=digest)
    end = (KVPoll.Success, KVPoll.Failed)
    if role == "prefill":
        kv[0].copy_(torch.arange(kv[0].numel()).view_as(kv[0]) % 251)
        meta.write(2, 91, {"output_ids": [7]})
        s = m.sender(91)
        wait_for(lambda: s.poll() == KVPoll.WaitingForInput, "prefill WaitingForInput", 30.0, 0.005)
        s.init(3, 2)
        s.send([3, 4, 5])
        wait_for(lambda: s.poll() in end, "prefill Success or Failed", 30.0, 0.005)
        q.put(("prefill", int(s.poll()), int(s.failure_reason()), dict(m.stats)))
    else:
        m.corrupt(91, offset=7)
        r = m.receiver(91)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.WaitingForInput, "decode WaitingForInput", 30.0, 0.005)
        r.send_metadata([9, 8, 10], 1)
        wait_for(lambda: r.poll() in end, "decode Success or Failed", 30.0, 0.005)
        wait_for(lambda: r.drained, "decode's request drained", 5.0, 0.005)
        want = (np.arange(kv[0].numel()).reshape(kv[0].shape) % 251)[[3, 4, 5]]
        differ = int((kv[0].numpy()[[9, 8, 10]] != want).sum())
        q.put(("decode", int(r.poll()), int(r.failure_reason()), dict(m.stats), differ))
    import time

    time.sleep(0.5)  # the last words are out before either side closes
    m.close()


def _run(backend, digest):
    import functools

    target = functools.partial(_corrupt_pair, digest=digest)
    return _pair(_Target(target), backend)


class _Target:
    """A picklable target taking (backend, role, port, q) as _pair calls it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, backend, role, port, q):
        self.fn(backend, role, port, q)


def test_a_corrupted_transfer_fails_checksum_mismatch_on_both_sides(backend):
    from lifecycle import FailureReason, KVPoll

    got, codes = _run(backend, True)
    assert codes == [0, 0]
    poll, reason, stats, differ = got["decode"]
    assert (poll, reason) == (KVPoll.Failed, FailureReason.CHECKSUM_MISMATCH)
    assert (stats["corrupted"], stats["digest_mismatches"], differ) == (1, 1, 1)
    assert got["prefill"][:2] == (KVPoll.Failed, FailureReason.CHECKSUM_MISMATCH)
    assert got["prefill"][2]["digest_bytes"] == stats["digest_bytes"] > 0


def test_with_the_digest_off_the_corruption_goes_unseen(backend):
    from lifecycle import KVPoll

    got, codes = _run(backend, False)
    assert codes == [0, 0]
    poll, _, stats, differ = got["decode"]
    assert poll == KVPoll.Success and differ == 1  # one wrong byte, and a Success
    assert (stats["corrupted"], stats["digests_checked"]) == (1, 0)
    assert got["prefill"][0] == KVPoll.Success
