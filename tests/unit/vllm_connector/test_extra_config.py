"""kv_connector_extra_config: every key checked, each refusal naming the key the
user wrote, nothing taken from a mapping that fails."""

import copy

import pytest

from lifecycle import FailureReason
from lifecycle.rules.recovery import FAIL_ALL, Action, preset
from transport.connector.config import ConnectorConfig
from transport.errors import ConfigError
from vllm_connector import SETTINGS, ExtraConfig, ExtraConfigError, ExtraConfigTypeError

OWNER = "kv_connector_extra_config"


def test_defaults_follow_vllms_own_settings():
    c = ExtraConfig.parse({}, kv_ip="10.0.0.7", kv_port=14579)
    assert c.backend == "mooncake"
    assert dict(c.fields) == {"store_host": "10.0.0.7", "store_port": 14579}
    assert c.recovery == FAIL_ALL  # vLLM's default kv_load_failure_policy is "fail"
    assert ExtraConfig.parse(None).recovery == FAIL_ALL
    assert ExtraConfig.parse({}, kv_load_failure_policy="recompute").recovery == preset("recompute")


def test_every_key_is_taken_and_reaches_the_connector_config():
    extra = {
        "backend": "nixl",
        "side": "decode",
        "store_host": "127.0.0.1",
        "store_port": 4000,
        "namespace": "pd-a",
        "bootstrap_timeout": 30.0,
        "waiting_timeout": None,
        "drain_timeout": 5.0,
        "heartbeat_interval": 0.25,
        "heartbeat_misses": 6,
        "digest": True,
        "recovery": "retry",
        "max_attempts": 5,
    }
    assert {s.key for s in SETTINGS} == set(extra)
    c = ExtraConfig.parse(extra)
    assert c.backend == "nixl"
    assert c.recovery == preset("retry", 5)
    cfg = c.connector("decode", 1, 2)
    assert isinstance(cfg, ConnectorConfig)
    assert (cfg.role, cfg.tp_rank, cfg.tp_size, cfg.store_port) == ("decode", 1, 2, 4000)
    assert (cfg.namespace, cfg.waiting_timeout, cfg.digest, cfg.heartbeat_misses) == (
        "pd-a",
        None,
        True,
        6,
    )


def test_recovery_per_reason_over_a_base():
    c = ExtraConfig.parse({"recovery": {"base": "fail", "peer_dead": "retry"}, "max_attempts": 4})
    assert c.recovery[FailureReason.PEER_DEAD].action is Action.RETRY
    assert c.recovery[FailureReason.PEER_DEAD].max_attempts == 4
    assert c.recovery[FailureReason.TRANSFER_ERROR].action is Action.FAIL
    c = ExtraConfig.parse(
        {"recovery": {"transfer_error": "fail"}}, kv_load_failure_policy="recompute"
    )
    assert c.recovery[FailureReason.TRANSFER_ERROR].action is Action.FAIL
    assert c.recovery[FailureReason.PEER_DEAD].action is Action.RECOMPUTE


BAD = [
    # (extra, error type, the name the message must hold, a word of what to pass)
    ("not a mapping", ExtraConfigTypeError, OWNER, "JSON object"),
    ({"bogus": 1}, ExtraConfigError, f'{OWNER}["bogus"]', "known key"),
    ({"backend": "carrier-pigeon"}, ExtraConfigError, f'{OWNER}["backend"]', "mooncake"),
    ({"backend": 3}, ExtraConfigTypeError, f'{OWNER}["backend"]', "mooncake"),
    ({"backend": "fake"}, ExtraConfigError, f'{OWNER}["backend"]', "nixl"),
    ({"store_port": 0}, ExtraConfigError, f'{OWNER}["store_port"]', "65535"),
    ({"store_port": "4000"}, ExtraConfigTypeError, f'{OWNER}["store_port"]', "integer"),
    ({"store_host": ""}, ExtraConfigError, f'{OWNER}["store_host"]', ""),
    ({"namespace": "a/b"}, ExtraConfigError, f'{OWNER}["namespace"]', "/"),
    ({"waiting_timeout": "soon"}, ExtraConfigTypeError, f'{OWNER}["waiting_timeout"]', ""),
    ({"bootstrap_timeout": -1}, ExtraConfigError, f'{OWNER}["bootstrap_timeout"]', ""),
    ({"drain_timeout": None}, ExtraConfigTypeError, f'{OWNER}["drain_timeout"]', ""),
    ({"heartbeat_misses": 1}, ExtraConfigError, f'{OWNER}["heartbeat_misses"]', "2"),
    ({"heartbeat_interval": 0}, ExtraConfigError, f'{OWNER}["heartbeat_interval"]', ""),
    ({"digest": "yes"}, ExtraConfigTypeError, f'{OWNER}["digest"]', ""),
    ({"recovery": "sometimes"}, ExtraConfigError, f'{OWNER}["recovery"]', "retry"),
    ({"recovery": 3}, ExtraConfigTypeError, f'{OWNER}["recovery"]', "reason"),
    ({"recovery": {"base": "x"}}, ExtraConfigError, f'{OWNER}["recovery"]["base"]', "retry"),
    (
        {"recovery": {"bogus": "fail"}},
        ExtraConfigError,
        f'{OWNER}["recovery"]["bogus"]',
        "peer_dead",
    ),
    (
        {"recovery": {"peer_dead": "maybe"}},
        ExtraConfigError,
        f'{OWNER}["recovery"]["peer_dead"]',
        "retry",
    ),
    ({"recovery": {"aborted": "retry"}}, ExtraConfigError, f'{OWNER}["recovery"]', "abort"),
    ({"side": "middle"}, ExtraConfigError, f'{OWNER}["side"]', "prefill"),
    ({"side": 1}, ExtraConfigTypeError, f'{OWNER}["side"]', "prefill"),
    ({"side": "prefill"}, ExtraConfigError, f'{OWNER}["side"]', "kv_consumer"),
    ({"max_attempts": 0}, ExtraConfigError, f'{OWNER}["max_attempts"]', "1..32767"),
    ({"max_attempts": "3"}, ExtraConfigTypeError, f'{OWNER}["max_attempts"]', "1..32767"),
    ({"max_attempts": True}, ExtraConfigTypeError, f'{OWNER}["max_attempts"]', "1..32767"),
]


@pytest.mark.parametrize(("extra", "kind", "name", "hint"), BAD, ids=[repr(b[0])[:40] for b in BAD])
def test_a_bad_value_is_refused_naming_its_key_and_nothing_is_taken(extra, kind, name, hint):
    before = copy.deepcopy(extra)
    with pytest.raises(kind) as e:
        ExtraConfig.parse(extra)
    msg = str(e.value)
    assert msg.startswith(name + ":"), msg
    assert hint in msg and "nothing was started" in msg
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)
    assert extra == before


def test_the_side_follows_kv_role_and_kv_both_must_name_it():
    assert ExtraConfig.parse({}, kv_role="kv_producer").side == "prefill"
    assert ExtraConfig.parse({}, kv_role="kv_consumer").side == "decode"
    assert ExtraConfig.parse({"side": "prefill"}, kv_role="kv_both").side == "prefill"
    with pytest.raises(ExtraConfigError, match=r'\["side"\].*kv_both'):
        ExtraConfig.parse({}, kv_role="kv_both")
    with pytest.raises(ConfigError, match=r"^KVTransferConfig\.kv_role"):
        ExtraConfig.parse({}, kv_role="kv_lender")


def test_vllms_own_settings_are_named_as_vllms():
    with pytest.raises(ConfigError, match=r"^KVTransferConfig\.kv_port: got 0"):
        ExtraConfig.parse({}, kv_port=0)
    with pytest.raises(ConfigError, match=r"^KVTransferConfig\.kv_load_failure_policy"):
        ExtraConfig.parse({}, kv_load_failure_policy="retry-forever")
    # a key the user wrote is named by that key, not by vLLM's setting it overrides
    with pytest.raises(ExtraConfigError, match=r'\["store_port"\]'):
        ExtraConfig.parse({"store_port": -5}, kv_port=0)
