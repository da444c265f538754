"""``kv_connector_extra_config``: what a vLLM user sets for the connector,
checked whole before any worker starts.

Every key is declared once in :data:`SETTINGS`, with what it holds; a key
that is not there is refused with the list of those that are. A key that
sets a :class:`~transport.connector.config.ConnectorConfig` field is checked
by that field's own validator (one rule, wherever the field is set), and its
refusal is reported under the key the user wrote. The rendezvous defaults to
vLLM's own ``kv_port`` on 127.0.0.1 (vLLM 0.34 has no ``kv_ip``: a store on
another host is ``store_host``); the recovery table, when none is given,
follows vLLM's ``kv_load_failure_policy`` ("recompute": what a new attempt
could cure is recomputed locally; "fail": every failure ends the request).

Recovery is a preset name (``"fail"``, ``"retry"``, ``"recompute"``) or a
mapping of failure reason (``"peer_dead"``, ...) to ``"fail"``,
``"recompute"`` or ``"retry"`` over that preset's table (``"base"``, default
the policy's preset), with ``max_attempts`` for every retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from lifecycle.errors import InvalidArgument
from lifecycle.reasons import FailureReason
from lifecycle.rules.recovery import FAIL_ALL, Action, RecoveryTable, Where, preset, retry
from transport.connector.config import ConnectorConfig
from transport.errors import ConfigError, ConfigTypeError
from transport.registry import known_backends

__all__ = ["SETTINGS", "ExtraConfig", "ExtraConfigError", "ExtraConfigTypeError"]

OWNER = "kv_connector_extra_config"
#: backends a vLLM engine cannot load KV through, and why
NOT_FOR_VLLM = {"fake": "moves no bytes: decode would run on KV nobody wrote"}
#: vLLM's kv_load_failure_policy values, and the recovery preset each stands for
POLICIES = {"recompute": "recompute", "fail": "fail"}
RECOVERY_WORDS = ("fail", "recompute", "retry")
WORDS = "'fail', 'retry' or 'recompute'"


@attrs.frozen
class Setting:
    """One key of ``kv_connector_extra_config``: ``field`` is the ConnectorConfig
    field it sets (None: the connector's own), ``holds`` what it takes."""

    key: str
    field: str | None
    holds: str


#: every key a user may set (the table the parser executes)
SETTINGS: tuple[Setting, ...] = (
    Setting("backend", None, "the transfer backend's name (default 'mooncake'; not 'fake')"),
    Setting("side", None, "'prefill' or 'decode' (default: from kv_role; needed for kv_both)"),
    Setting("store_host", "store_host", "the rendezvous store's host (default 127.0.0.1)"),
    Setting("store_port", "store_port", "the rendezvous store's port (default: kv_port)"),
    Setting("namespace", "namespace", "prefix of every store key (one per P/D deployment)"),
    Setting("bootstrap_timeout", "bootstrap_timeout", "seconds a handshake may take, or null"),
    Setting("waiting_timeout", "waiting_timeout", "seconds a transfer may take, or null"),
    Setting("drain_timeout", "drain_timeout", "seconds an abort waits for writes in flight"),
    Setting("heartbeat_interval", "heartbeat_interval", "seconds between heartbeats"),
    Setting("heartbeat_misses", "heartbeat_misses", "heartbeats missed before a peer is dead"),
    Setting("digest", "digest", "true: every transfer's bytes are hashed and checked"),
    Setting("recovery", None, "'fail', 'retry', 'recompute', or {reason: one of those}"),
    Setting("max_attempts", None, "attempts in all for a request retried (default 3)"),
)
_BY_KEY = {s.key: s for s in SETTINGS}


class ExtraConfigError(ConfigError):
    """A value of ``kv_connector_extra_config`` (or the mapping itself) that the
    connector cannot take; raised before any worker starts. ``path``: the keys
    that lead to it (empty: the mapping itself)."""

    def __init__(self, path: tuple[str, ...], value: object, allowed: str) -> None:
        self.path = path
        super().__init__(OWNER + "".join(f'["{k}"]' for k in path), value, allowed)


class ExtraConfigTypeError(ExtraConfigError, ConfigTypeError):
    """A value of the wrong type (also a TypeError)."""


@attrs.frozen
class ExtraConfig:
    """The checked settings: the backend's name, the ConnectorConfig fields the
    user set (every other field keeps its default) and the recovery table."""

    backend: str
    fields: Mapping[str, Any]
    recovery: RecoveryTable
    #: the connector's role on this engine: "prefill" or "decode"
    side: str = "decode"

    @classmethod
    def parse(
        cls,
        extra: object,
        kv_ip: str = "127.0.0.1",
        kv_port: int = 14579,
        kv_load_failure_policy: str = "fail",
        kv_role: str = "kv_consumer",
    ) -> ExtraConfig:
        """Check every key of ``extra`` (vLLM's ``kv_connector_extra_config``) and
        build the settings; the first refusal names its key."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ExtraConfigTypeError((), extra, "a JSON object of settings")
        for key in extra:
            if key not in _BY_KEY:
                raise ExtraConfigError(
                    (str(key),), extra[key], f"a known key: {', '.join(s.key for s in SETTINGS)}"
                )
        backend = extra.get("backend", "mooncake")
        known = [b for b in known_backends() if b not in NOT_FOR_VLLM]
        if not isinstance(backend, str):
            raise ExtraConfigTypeError(("backend",), backend, f"one of {', '.join(known)}")
        if backend not in known:
            raise ExtraConfigError(("backend",), backend, f"one of {', '.join(known)}")
        fields = {"store_host": kv_ip, "store_port": kv_port}
        fields |= {s.field: extra[s.key] for s in SETTINGS if s.field and s.key in extra}
        _probe(fields, extra)
        side = _side(extra, kv_role)
        return cls(backend, fields, _recovery(extra, kv_load_failure_policy), side)

    def connector(self, role: str, tp_rank: int, tp_size: int, **more: Any) -> ConnectorConfig:
        """This rank's ConnectorConfig: the settings, its place, and what the
        engine knows (``more``: kv_heads, dp_rank, ...)."""
        return ConnectorConfig(role=role, tp_rank=tp_rank, tp_size=tp_size, **self.fields, **more)


def _key_of(field: str, extra: Mapping[str, Any]) -> str:
    """The key a user wrote for ``field`` (vLLM's own name when it came from there)."""
    for s in SETTINGS:
        if s.field == field and s.key in extra:
            return s.key
    return {"store_host": "kv_ip", "store_port": "kv_port"}.get(field, field)


def _probe(fields: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
    """Run ConnectorConfig's own validators over the fields; a refusal is named
    by the key the user wrote."""
    try:
        ConnectorConfig(role="decode", tp_rank=0, **fields)
    except ConfigError as e:
        key = _key_of(e.field, extra)
        err = ExtraConfigTypeError if isinstance(e, TypeError) else ExtraConfigError
        if key in _BY_KEY:
            raise err((key,), e.value, e.allowed) from None
        raise ConfigError(key, e.value, e.allowed, "KVTransferConfig") from None


#: the side each of vLLM's kv_role values stands for (kv_both: the "side" key says)
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": None}


def _side(extra: Mapping[str, Any], kv_role: str) -> str:
    if kv_role not in ROLES:
        raise ConfigError("kv_role", kv_role, ", ".join(map(repr, ROLES)), "KVTransferConfig")
    side = extra.get("side", ROLES[kv_role])
    if side is None:
        raise ExtraConfigError(
            ("side",), None, "'prefill' or 'decode': with kv_role 'kv_both' this engine's side"
        )
    if side not in ("prefill", "decode") or (ROLES[kv_role] not in (None, side)):
        raise (ExtraConfigError if isinstance(side, str) else ExtraConfigTypeError)(
            ("side",), side, f"'prefill' or 'decode', matching kv_role {kv_role!r}"
        )
    return str(side)


def _recovery(extra: Mapping[str, Any], policy: str) -> RecoveryTable:
    if policy not in POLICIES:
        raise ConfigError(
            "kv_load_failure_policy", policy, "'recompute' or 'fail'", "KVTransferConfig"
        )
    attempts = extra.get("max_attempts", 3)
    if not isinstance(attempts, int) or isinstance(attempts, bool) or not 1 <= attempts < 1 << 15:
        wrong_type = not isinstance(attempts, int) or isinstance(attempts, bool)
        raise (ExtraConfigTypeError if wrong_type else ExtraConfigError)(
            ("max_attempts",), attempts, "an integer in 1..32767"
        )
    spec = extra.get("recovery")
    if spec is None:
        return FAIL_ALL if POLICIES[policy] == "fail" else preset("recompute", attempts)
    if isinstance(spec, str):
        if spec not in RECOVERY_WORDS:
            raise ExtraConfigError(("recovery",), spec, WORDS)
        return preset(spec, attempts)
    if not isinstance(spec, Mapping):
        raise ExtraConfigTypeError(("recovery",), spec, f"{WORDS}, or {{reason: one of those}}")
    base = spec.get("base", POLICIES[policy])
    if base not in RECOVERY_WORDS:
        raise ExtraConfigError(("recovery", "base"), base, WORDS)
    changes: dict[str, Any] = {}
    retried = preset("retry", attempts)
    for reason, word in spec.items():
        if reason == "base":
            continue
        path = ("recovery", str(reason))
        try:
            r = FailureReason[str(reason).upper()]
        except KeyError:
            names = ", ".join(x.name.lower() for x in FailureReason if x is not FailureReason.NONE)
            raise ExtraConfigError(
                path, word, f"a key that names a failure reason: {names}"
            ) from None
        if word not in RECOVERY_WORDS:
            raise ExtraConfigError(path, word, WORDS)
        if word == "retry":  # (where the next attempt goes: the reason's default)
            where = retried[r].where if retried[r].action is Action.RETRY else Where.SAME
            changes[r.name.lower()] = retry(attempts, where)
        else:
            changes[r.name.lower()] = word
    try:
        return preset(base, attempts).override(**changes)
    except InvalidArgument as e:
        raise ExtraConfigError(("recovery",), dict(spec), e.expected) from None


def _check_declaration() -> None:
    """Every key is declared once, and each field a key sets is a ConnectorConfig field."""
    fields = {f.name for f in attrs.fields(ConnectorConfig)}
    unknown = [s.key for s in SETTINGS if s.field is not None and s.field not in fields]
    if unknown or len(_BY_KEY) != len(SETTINGS):
        raise AssertionError(f"SETTINGS: keys {unknown} set no ConnectorConfig field, or repeat")


_check_declaration()
