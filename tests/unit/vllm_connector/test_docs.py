"""docs/vllm.md names every key of kv_connector_extra_config."""

from pathlib import Path

from vllm_connector import SETTINGS

DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def test_every_setting_is_documented():
    text = DOC.read_text()
    assert [s.key for s in SETTINGS if f"`{s.key}`" not in text] == []


def test_an_undocumented_key_would_be_seen():
    assert "`no_such_key`" not in DOC.read_text()
