import os

from hypothesis import HealthCheck, settings

# one definition for every test directory; a conftest offers a fixture by its name
from support.process_groups import world_of_one as world_of_one

# Each TCPStore client connect reverse-resolves its loopback address, which it
# holds as ::ffff:127.0.0.1: /etc/hosts lists only 127.0.0.1, so the query goes
# to DNS, and a resolver that drops one stalls the connect for glibc's default
# 5 s (a test waiting 10 s for a handshake then fails). The answer is only a
# name in a log line: the tests, and the ranks they spawn, wait 1 s for it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "deep",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
