"""kv_transfer_params: prefill's answer is what decode's request carries, and a
malformed one is refused naming the request and the key."""

import pytest

from vllm_connector import ParamsError, TransferParams, room_of

GOOD = TransferParams.answer(
    room=77,
    epoch=1,
    engine_id="prefill-engine",
    request_id="cmpl-1-p",
    host="127.0.0.1",
    port=5600,
    tp_size=2,
    block_ids=[[4, 5, 9]],
)


def test_prefills_answer_is_read_back_whole():
    p = TransferParams.from_params("cmpl-1-d", dict(GOOD))
    assert p == TransferParams(
        77, 1, "prefill-engine", "cmpl-1-p", "127.0.0.1", 5600, 2, ((4, 5, 9),)
    )
    # vLLM's own keys, so its proxy copies them unchanged
    assert GOOD["do_remote_prefill"] is True and GOOD["do_remote_decode"] is False


def test_block_ids_per_group_or_one_flat_list():
    two = {**GOOD, "remote_block_ids": [[1, 2], [7]]}
    assert TransferParams.from_params("r", two).block_ids == ((1, 2), (7,))
    flat = {**GOOD, "remote_block_ids": [3, 4]}
    assert TransferParams.from_params("r", flat).block_ids == ((3, 4),)


def test_params_that_ask_no_load_give_none():
    assert TransferParams.from_params("r", None) is None
    assert TransferParams.from_params("r", {"do_remote_decode": True}) is None
    assert TransferParams.from_params("r", {**GOOD, "do_remote_prefill": False}) is None


def test_the_epoch_defaults_to_the_first_attempt():
    p = {k: v for k, v in GOOD.items() if k != "pdlife_epoch"}
    assert TransferParams.from_params("r", p).epoch == 0


def test_without_pdlife_room_the_room_is_the_one_prefill_derives():
    # prefill's room is room_of(its request id): a router that forwards only
    # vLLM's keys (or vLLM's own tests) still lands on the same room
    p = {k: v for k, v in GOOD.items() if k not in ("pdlife_room", "pdlife_epoch")}
    got = TransferParams.from_params("r", p)
    assert got.room == room_of("cmpl-1-p") and got.epoch == 0
    assert "pdlife_room" not in TransferParams.KEYS


@pytest.mark.parametrize("key", TransferParams.KEYS)
def test_a_missing_key_is_named(key):
    p = {k: v for k, v in GOOD.items() if k != key}
    with pytest.raises(ParamsError, match=rf'request r7: kv_transfer_params\["{key}"\]'):
        TransferParams.from_params("r7", p)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("pdlife_room", 0),
        ("pdlife_room", 1 << 64),
        ("pdlife_room", "77"),
        ("pdlife_epoch", -1),
        ("remote_port", 70000),
        ("remote_port", True),
        ("tp_size", 0),
        ("remote_host", ""),
        ("remote_engine_id", 5),
        ("remote_block_ids", [1, -2]),
        ("remote_block_ids", "4,5"),
        ("remote_block_ids", [1.0]),
        ("remote_block_ids", [[1], 2]),
        ("remote_block_ids", [[1], [-2]]),
    ],
)
def test_a_malformed_value_is_named_with_the_request(key, value):
    p = {**GOOD, key: value}
    with pytest.raises(ParamsError) as e:
        TransferParams.from_params("cmpl-9", p)
    assert e.value.key == key and e.value.request_id == "cmpl-9"
    assert str(e.value).startswith(f'request cmpl-9: kv_transfer_params["{key}"] is {value!r}')
    assert isinstance(e.value, ValueError)


def test_params_that_are_not_a_mapping_are_refused():
    with pytest.raises(ParamsError, match="a JSON object"):
        TransferParams.from_params("r", ["do_remote_prefill"])


def test_a_rooms_id_is_stable_and_never_zero():
    assert room_of("cmpl-1") == room_of("cmpl-1") != room_of("cmpl-2")
    assert 0 < room_of("") < 1 << 64
    with pytest.raises(TypeError):
        room_of(5)
