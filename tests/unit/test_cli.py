"""`pdlife` on bad input: one line on stderr naming the argument or file,
exit 2, no traceback, and nothing spawned."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdlife.cli import main


def run(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse exits on its own errors
        return e.code


_TWO_RANKS = {"ranks": {"prefill": 1, "decode": 1}}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "bad.toml").write_text("seed = \n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "rank9.json").write_text(
        json.dumps({"faults": [{"kind": "fail", "rank": 9, "request": 1}]})
    )
    (tmp_path / "req.json").write_text(
        json.dumps({"faults": [{"kind": "fail", "rank": 0, "request": 500}]})
    )
    (tmp_path / "badat.json").write_text(
        json.dumps({"faults": [{"kind": "fail", "rank": 0, "request": 1, "at": "Soon"}]})
    )
    (tmp_path / "mode.toml").write_text('mode = "sometimes"\n')
    (tmp_path / "afile").write_text("")
    (tmp_path / "binary.json").write_bytes(bytes(range(256)))
    (tmp_path / "binary.toml").write_bytes(b"seed = 1\n\xff\xfe\x00")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    _run_dir(tmp_path / "corrupt", {0: '{"t": "obs", "step": 1, "rank"', 1: ""})
    _run_dir(tmp_path / "short", {0: json.dumps({"t": "obs", "step": 1, "rooms": [1]}), 1: ""})
    _run_dir(tmp_path / "binarytrace", {0: _obs(0, "prefill"), 1: b"\x80\x81\n"})
    # a rank's trace missing: what is left replays without a difference
    _run_dir(tmp_path / "onerank", {0: _obs(0, "prefill")})
    _run_dir(tmp_path / "nosummary", {0: _obs(0, "prefill"), 1: _obs(1, "decode")}, summary=None)
    _run_dir(tmp_path / "oldsummary", {0: _obs(0, "prefill"), 1: _obs(1, "decode")}, summary={})
    _run_dir(tmp_path / "extra", {r: _obs(r, "prefill") for r in (0, 1, 5)})
    (tmp_path / "empty").mkdir()
    (tmp_path / "events.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "badevents.json").write_text(json.dumps({"traceEvents": [{"ph": "b"}]}))
    (tmp_path / "noevents.json").write_text(json.dumps({"events": []}))
    return tmp_path


def _obs(rank, side):
    return json.dumps(
        {
            "t": "obs",
            "step": 1,
            "rank": rank,
            "side": side,
            "queue": "q",
            "rooms": [7],
            "local": [2],
            "reason": [15],
            "agreed": [2],
        }
    )


def _run_dir(path: Path, traces, summary=_TWO_RANKS):
    """A run directory: ``summary.json`` (None: none) and trace/rank{R}.jsonl."""
    (path / "trace").mkdir(parents=True)
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    for r, text in traces.items():
        f = path / "trace" / f"rank{r}.jsonl"
        f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text + "\n")


# (argv, the words the one line must contain); {d} is a scratch directory
BAD = [
    (["simulate", "--fail-prob", "1.5"], "--fail-prob"),
    (["simulate", "--fail-prob", "nan"], "--fail-prob"),
    (["simulate", "--fail-prob", "lots"], "--fail-prob"),
    (["simulate", "--abort-prob", "-0.1"], "--abort-prob"),
    (["simulate", "--backend", "nonsense"], "--backend nonsense"),
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--seed", "1e3"], "--seed"),
    (["simulate", "--prefill", "0"], "--prefill"),
    (["simulate", "--decode", "-2"], "--decode"),
    (["simulate", "--prefill", "40", "--decode", "40"], "--prefill-tp/--prefill-dp/--decode-tp"),
    (["simulate", "--prefill-tp", "2", "--prefill-dp", "40"], "--prefill-tp/--prefill-dp"),
    (["simulate", "--prefill-dp", "0"], "--prefill-dp"),
    (["simulate", "--decode-tp", "0"], "--decode-tp"),
    (["simulate", "--page-size", "0"], "--page-size"),
    (["simulate", "--prefill-tp", "4", "--kv-heads", "3"], "--kv-heads 3"),
    (["simulate", "--decode-tp", "3", "--kv-heads", "4"], "--kv-heads 4"),
    (["simulate", "--mla", "--kv-heads", "8"], "--kv-heads 8"),
    (["simulate", "--staging-pages", "4"], "--staging-pages"),
    (["simulate", "--decode-tp", "4", "--staging", "--staging-pages", "31"], "--staging-pages 31"),
    (["simulate", "--prefix-pages", "32"], "--prefix-pages 32"),
    (["simulate", "--prefix-pages", "4", "--max-pages-per-request", "4"], "--prefix-pages 4"),
    (["simulate", "--state-split"], "--state-split"),
    (["simulate", "--prefill-tp", "3", "--state", "--state-split"], "TP sizes 3 and 2"),
    (["simulate", "--requests", "0"], "--requests"),
    (["simulate", "--requests", "-5"], "--requests"),
    (["simulate", "--max-steps", "0"], "--max-steps"),
    (["simulate", "--timeout", "0"], "--timeout"),
    (["simulate", "--pg-timeout", "-1"], "--pg-timeout"),
    (["simulate", "--soak", "0"], "--soak"),
    (["simulate", "--soak", "5", "--requests", "10"], "--soak"),
    (["simulate", "--kill-rank", "9"], "--kill-rank 9"),
    (["simulate", "--kill-rank", "1", "--kill-step", "0"], "--kill-step"),
    (["simulate", "--pause-rank", "9"], "--pause-rank 9"),
    (["simulate", "--pause-rank", "1", "--pause-seconds", "0"], "--pause-seconds"),
    (["simulate", "--pause-rank", "1", "--pause-seconds", "7200"], "--pause-seconds"),
    (["simulate", "--pause-rank", "1", "--pause-step", "0"], "--pause-step"),
    (["simulate", "--pause-seconds", "2"], "--pause-rank R"),
    (["simulate", "--pause-rank", "1", "--pause-seconds", "15"], "--pg-timeout 15"),
    (["simulate", "--pause-rank", "1", "--pause-seconds", "9", "--timeout", "5"], "--timeout 5"),
    (["simulate", "--peer-outage", "0:5"], "RANK:STEP:SECONDS"),
    (["simulate", "--peer-outage", "0:0:2"], "the step >= 1"),
    (["simulate", "--peer-outage", "3:5:2"], "choose 0..1"),
    (["simulate", "--peer-outage", "0:5:2", "--pause-rank", "1"], "drop --pause-rank"),
    (["simulate", "--recovery", "sometimes"], "--recovery"),
    (["simulate", "--max-attempts", "0"], "--max-attempts"),
    (["simulate", "--corrupt-prob", "2"], "--corrupt-prob"),
    (["simulate", "--corrupt-prob", "0.1", "--backend", "fake"], "--corrupt-prob 0.1"),
    (["simulate", "--metrics-port", "99999"], "--metrics-port"),
    (["simulate", "--metrics-port", "65535"], "--metrics-port"),
    (["simulate", "--fault-mode", "sometimes"], "--fault-mode"),
    (["simulate", "--plan", "{d}/missing.json"], "missing.json"),
    (["simulate", "--plan", "{d}/bad.json"], "not valid JSON"),
    (["simulate", "--plan", "{d}/bad.toml"], "not valid TOML"),
    (["simulate", "--plan", "{d}/list.json"], "--plan"),
    (["simulate", "--plan", "{d}/rank9.json"], "faults[0].rank"),
    (["simulate", "--plan", "{d}/req.json"], "faults[0].request"),
    (["simulate", "--plan", "{d}/badat.json"], "faults[0].at"),
    (["simulate", "--plan", "{d}/mode.toml"], "mode"),
    (["simulate", "--plan", "{d}/binary.json"], "binary.json: not a text file: byte 128 (0x80)"),
    (["simulate", "--plan", "{d}/binary.toml"], "binary.toml: not a text file: byte 9 (0xff)"),
    (["simulate", "--plan", "{d}/deep.json"], "deep.json: not valid JSON: nested too deeply"),
    (["simulate", "--plan", "{d}/missing.json", "--kill-rank", "1"], "--plan: fault plan: "),
    (["simulate", "--plan", "{d}/binary.json", "--pause-rank", "1"], "binary.json"),
    (["simulate", "--out", "{d}/afile/sub"], "--out"),
    (["simulate", "--compare", "{d}/nowhere", "{d}/empty"], "--compare"),
    (["simulate", "--bogus"], "--bogus"),
    (["replay", "{d}/nonexistent"], "nonexistent"),
    (["replay", "{d}/empty"], "trace"),
    (["replay", "{d}/corrupt"], "corrupt"),
    (["replay", "{d}/short"], "corrupt"),
    (["replay", "{d}/binarytrace"], "rank1.jsonl:1: not JSON"),
    (["replay", "{d}/onerank"], "onerank/trace/rank1.jsonl is missing: the run had 2 ranks"),
    (["replay", "{d}/nosummary"], "no summary.json"),
    (["replay", "{d}/oldsummary"], "does not say how many ranks"),
    (["replay", "{d}/extra"], "rank5.jsonl is from no rank of this run"),
    (["why", "x", "{d}/empty"], "'x' is not a room"),
    (["why", "-5", "{d}/empty"], "room"),
    (["why", "7", "{d}/nonexistent"], "nonexistent"),
    (["why", "7", "{d}/corrupt"], "corrupt"),
    (["trace", "export", "--perfetto", "{d}/nonexistent"], "nonexistent"),
    (["trace", "export", "{d}/empty"], "--perfetto"),
    (["trace", "export", "--perfetto", "{d}/corrupt"], "corrupt"),
    (["trace", "export", "--perfetto", "--otlp", "{d}/empty"], "--otlp"),
    (["trace", "export", "--otlp", "-o", "x.json", "{d}/empty"], "--output"),
    (["trace", "export", "--perfetto", "--endpoint", "http://h/v1/traces", "{d}/empty"], "--otlp"),
    (["trace", "export", "--otlp", "--endpoint", "ftp://h", "{d}/empty"], "--endpoint ftp://h"),
    (["trace", "export", "--otlp", "--volume", "all", "{d}/empty"], "--volume"),
    (["trace", "export", "--otlp", "--sample", "2", "{d}/empty"], "--sample"),
    (["trace", "export", "--otlp", "--endpoint", "http://127.0.0.1:9/", "{d}/corrupt"], "corrupt"),
    (
        ["trace", "export", "--otlp", "--endpoint", "http://127.0.0.1:9/", "{d}/nonexistent"],
        "nonexistent",
    ),
    (["simulate", "--otlp-traces-endpoint", "localhost:4318"], "--otlp-traces-endpoint localhost"),
    (["trace", "spans", "{d}/corrupt"], "corrupt"),
    (["trace", "spans", "{d}/empty", "--room", "x"], "--room"),
    (["trace", "spans", "{d}/empty", "--room", "0"], "--room"),
    (["trace", "picture", "{d}/nonexistent.json"], "nonexistent.json"),
    (["trace", "picture", "{d}/afile"], "afile"),
    (["trace", "picture", "{d}/deep.json"], "deep.json"),
    (["trace", "picture", "{d}/binary.json"], "binary.json"),
    (["trace", "picture", "{d}/noevents.json"], "traceEvents"),
    (["trace", "picture", "{d}/badevents.json"], "badevents.json"),
    (["trace", "picture", "{d}/events.json", "--rooms", "0"], "--rooms"),
    (["trace", "picture", "{d}/events.json", "-o", "{d}/nodir/x.png"], "--output"),
    (["bench", "--sizes", "x"], "--sizes"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench-transfer", "--mib", "-1"], "--mib"),
    (["engine-memory", "--entries", "0"], "--entries"),
    (["diagram", "--role", "x"], "--role"),
    (["nonsense"], "nonsense"),
    ([], "command"),
]


@pytest.mark.parametrize(("argv", "named"), BAD, ids=[" ".join(a) or "<none>" for a, _ in BAD])
def test_bad_invocation_is_one_line_and_exit_2(argv, named, files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    monkeypatch.setenv("SGLANG_TEST_DISAGG_FAILURE_PROB", "")
    argv = [a.replace("{d}", str(files)) for a in argv]
    if argv and argv[0] == "simulate" and "--out" not in argv and "--compare" not in argv:
        argv += ["--out", str(files / "out")]
    rc = run(argv)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 2, cap.err
    assert len(lines) == 1, cap.err
    assert "Traceback" not in cap.err + cap.out
    assert named in lines[0]
    assert not (files / "out" / "ranks").exists()  # nothing was started


def test_the_installed_entry_point_prints_no_traceback(tmp_path):
    for argv in (["simulate", "--seed", "-1"], ["replay", str(tmp_path / "x")]):
        proc = subprocess.run(
            [sys.executable, "-m", "pdlife", *argv], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr


def test_an_unexpected_error_is_still_one_line(monkeypatch, capsys, tmp_path):
    from pdlife.run import simulate

    def boom(*a, **k):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(simulate, "simulate", boom)
    rc = run(["simulate", "--backend", "fake", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and "disk on fire second line" in err
    assert "PDLIFE_DEBUG" in err


def _summary(path: Path, outcomes, backend="fake"):
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({"backend": backend, "outcomes": outcomes}))
    return path


def test_compare_names_the_first_differing_request(tmp_path, capsys):
    same = {"11": ["Success", "none"], "5": ["Failed", "injected fault"]}
    a = _summary(tmp_path / "a", same)
    b = _summary(tmp_path / "b", dict(same), backend="mooncake")
    assert run(["simulate", "--compare", str(a), str(b)]) == 0
    assert "the 2 requests end the same" in capsys.readouterr().out
    c = _summary(
        tmp_path / "c",
        {"11": ["Failed", "aborted"], "5": ["Failed", "transfer error"], "7": ["Success", "none"]},
    )
    assert run(["simulate", "--compare", str(a), str(c / "summary.json")]) == 1
    out = capsys.readouterr().out
    assert (
        "3 requests differ; first: room 5: Failed (injected fault) vs Failed (transfer error)"
        in (out.replace(" of 3", ""))
    )


def test_the_output_directory_check_survives_ranks_checking_at_once(tmp_path):
    """Under torchrun every rank checks --out at the same moment; a shared probe
    file made one of them fail with exit 2."""
    import threading

    from pdlife.args import writable_dir

    errors = []

    def check():
        try:
            for _ in range(300):
                writable_dir(tmp_path / "out", "--out")
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert list((tmp_path / "out").iterdir()) == []


def _parsed(*argv, out):
    from pdlife.cli import build_parser

    return build_parser().parse_args(["simulate", "--backend", "fake", "--out", str(out), *argv])


def test_topology_flags_reach_the_config(tmp_path):
    from pdlife.run.config import sim_config

    cfg, _ = sim_config(
        _parsed(
            "--prefill-tp", "2", "--decode-tp", "4", "--prefill-dp", "3", "--staging",
            "--staging-pages", "29", "--state", "--page-size", "2", "--prefix-pages", "3",
            out=tmp_path,
        )
    )  # fmt: skip
    assert (cfg.prefill, cfg.decode, cfg.prefill_dp, cfg.world) == (2, 4, 3, 10)
    assert (cfg.staging, cfg.staging_pages, cfg.state) == (True, 29, True)
    assert (cfg.page_size, cfg.prefix_pages, cfg.total_heads) == (2, 3, 8)
    old, _ = sim_config(_parsed("--prefill", "3", "--decode", "1", out=tmp_path))
    assert (old.prefill, old.decode, old.world, old.total_heads) == (3, 1, 4, 6)
    mla, _ = sim_config(_parsed("--mla", "--prefill-tp", "2", "--decode-tp", "1", out=tmp_path))
    assert mla.total_heads == 1


def test_staging_without_head_slicing_is_allowed_and_said_to_do_nothing(tmp_path):
    from pdlife.run.config import sim_config, staging_note

    same, _ = sim_config(_parsed("--staging", out=tmp_path))
    assert "nothing to scatter" in staging_note(same)
    mla, _ = sim_config(_parsed("--staging", "--mla", "--decode-tp", "1", out=tmp_path))
    assert "MLA" in staging_note(mla)
    sliced, _ = sim_config(_parsed("--staging", "--decode-tp", "4", out=tmp_path))
    assert staging_note(sliced) is None


def test_a_torchrun_world_that_does_not_fit_the_prefill_dp_groups_is_refused(
    tmp_path, monkeypatch, capsys
):
    # 2 DP groups of 2 prefill ranks and 2 decode ranks need 6 processes, not 4
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    rc = run(["simulate", "--backend", "fake", "--out", str(tmp_path), "--prefill-dp", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "torchrun started 4 ranks but they add up to 6" in err[0]


def test_replay_refuses_a_run_with_a_rank_trace_missing(tmp_path, capsys):
    """With one rank's trace gone, replay checked what was left and said
    "no difference" (exit 0); the run's rank count is in summary.json."""
    d = tmp_path / "run"
    _run_dir(d, {0: _obs(0, "prefill"), 1: _obs(1, "decode")})
    assert run(["replay", str(d)]) == 0  # every rank's trace: each side's step replayed
    assert "2 collective steps recomputed; no difference" in capsys.readouterr().out
    (d / "trace" / "rank1.jsonl").unlink()
    assert run(["replay", str(d)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    (line,) = cap.err.strip().splitlines()
    assert f"{d / 'trace' / 'rank1.jsonl'} is missing" in line
    assert "the run had 2 ranks" in line and "copy rank 1's trace there" in line
