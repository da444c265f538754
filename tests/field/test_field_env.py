"""The field env holds the real SGLang 0.5.23, and its disaggregation modules import.

Run through `make field-test` (in .venv-field); see conftest.py.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata

import pytest
from names import defined_names

VERSION = "0.5.23"
DISAGG = "sglang.srt.disaggregation"
MODULES = [
    "utils",
    "decode",
    "prefill",
    "base.conn",
    "common.conn",
    "fake.conn",
    "mooncake.conn",
    "nixl.conn",
    "checksum",
]


def test_sglang_is_0_5_23() -> None:
    import sglang

    assert sglang.__version__ == VERSION
    assert metadata.version("sglang") == VERSION


def test_torch_and_torchvision_are_the_field_pairing() -> None:
    import torch
    import torchvision
    import torchvision.transforms  # what SGLang's import chain needs of it

    assert metadata.version("torch") == "2.14.1"
    assert metadata.version("torchvision") == "0.29.1"
    assert torch.__version__.startswith("2.14.1")
    assert torchvision.__version__.startswith("0.29.1")
    assert (torch.ones(2) + 1).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("name", MODULES)
def test_disaggregation_module_imports(name: str) -> None:
    module = importlib.import_module(f"{DISAGG}.{name}")
    assert module.__name__ == f"{DISAGG}.{name}"


def test_poll_and_all_reduce_signature() -> None:
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    params = inspect.signature(poll_and_all_reduce).parameters.values()
    plain = inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params])
    assert str(plain) == "(pollers, gloo_group, decode_reqs=None, metadata_buffers=None)"


def test_names_lists_what_a_module_defines_and_not_what_it_imports() -> None:
    utils = importlib.import_module(f"{DISAGG}.utils")
    conn = importlib.import_module(f"{DISAGG}.base.conn")

    found = {n.name: n for n in defined_names(utils)}
    assert found["poll_and_all_reduce"].kind == "function"
    assert found["poll_and_all_reduce"].signature.startswith("(pollers, gloo_group")
    assert found["FAKE_BOOTSTRAP_HOST"].signature == "= '2.2.2.2'"
    assert found["TransferBackend"].kind == "enum"
    imported = {"KVPoll", "torch", "np", "dist"}  # utils has them from base.conn, torch, numpy
    assert imported <= set(vars(utils))
    assert imported.isdisjoint(found)

    conn_names = {n.name: n for n in defined_names(conn)}
    assert {"KVPoll", "KVArgs", "BaseKVSender", "BaseKVReceiver"} <= set(conn_names)
    assert conn_names["BaseKVSender"].kind == "abstract class"
    imported = {"ServerArgs", "ABC", "abstractmethod", "Optional", "np"}
    assert imported <= set(vars(conn))
    assert imported.isdisjoint(conn_names)
    assert [n.name for n in defined_names(conn)] == sorted(conn_names)
