import pytest


@pytest.fixture(autouse=True)
def _no_fault_env(monkeypatch):
    for var in (
        "SGLANG_TEST_DISAGG_FAILURE_PROB",
        "DISAGGREGATION_TEST_FAILURE_PROB",
        "PDLIFE_FAULT_SEED",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _release_from_each_test(monkeypatch):
    """Every test starts on the default rule (no choice, no variable) and leaves no choice behind."""
    from field.release import set_release

    monkeypatch.delenv("PDLIFE_FIELD_RELEASE", raising=False)
    monkeypatch.delenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", raising=False)
    set_release(None)
    yield
    set_release(None)


@pytest.fixture(params=["seed", "0.5.23"])
def field_release(request):
    """Run the test under each field release's conventions."""
    from field.release import set_release

    set_release(request.param)
    yield request.param
    set_release(None)


@pytest.fixture
def seed():
    from field.release import set_release

    set_release("seed")
    yield "seed"
    set_release(None)


@pytest.fixture
def v0523():
    from field.release import set_release

    set_release("0.5.23")
    yield "0.5.23"
    set_release(None)
