"""The Mooncake engine's status call reads only a batch's first task and frees
the batch then: a multi-entry batch leaks (linear RSS growth measured on the
raw engine) and may count as landed early. The backend submits one entry per batch."""

import pytest

try:
    import mooncake.engine  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(f"Mooncake engine not usable here ({e})", allow_module_level=True)

from transport.mooncake import MooncakeConfig, MooncakeManager, _Req
from transport.status_arrays import StatusArrays


class Engine:
    def __init__(self):
        self.submitted = []

    def batch_transfer_async_write(self, endpoint, srcs, dsts, lens):
        self.submitted.append((srcs, dsts, lens))
        return len(self.submitted)

    def transfer_check_status(self, bid):
        return 0


def test_every_entry_is_its_own_batch():
    m = object.__new__(MooncakeManager)
    StatusArrays.__init__(m)
    m.engine = Engine()
    m.config = MooncakeConfig(role="prefill", tp_rank=0)
    req = _Req(5, m.take(3), 0)
    m._submit(req, {"endpoint": "127.0.0.1:1"}, [10, 20, 30], [11, 21, 31], [4, 4, 8])
    assert m.engine.submitted == [([10], [11], [4]), ([20], [21], [4]), ([30], [31], [8])]
    assert req.batches == [1, 2, 3]
