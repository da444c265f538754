"""How `pdlife` starts: a command loads only its own module, the simulator's
ranks fork from a launcher that never ran an engine, and a probe's failure is
one usage error. The fork path needs a process without threads of its own, so
those checks run in a fresh interpreter (a pytest worker has threads)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import pdlife
from pdlife.run import launch


def _python(code: str, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter; what it prints last, as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_command_module_adds_exactly_its_commands():
    class Sub:
        def __init__(self):
            self.names = []

        def add_parser(self, name, **kw):
            import argparse

            self.names.append(name)
            return argparse.ArgumentParser(prog=name)

    for name, module in pdlife.COMMANDS.items():
        sub = Sub()
        pdlife.register_commands(sub, [name])
        # the module adds this command and only commands the table gives it
        assert name in sub.names
        assert {pdlife.COMMANDS[n] for n in sub.names} == {module}, (name, sub.names)


@pytest.mark.parametrize("argv", [["replay", "/nonexistent"], ["diagram"], ["replay"]])
def test_replay_and_diagram_never_load_torch_or_the_simulator(argv):
    got = _python(
        f"""
        import contextlib, io, json, sys
        from pdlife.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                rc = main({argv!r})
            except SystemExit as e:
                rc = e.code
        print(json.dumps({{"rc": rc, "torch": "torch" in sys.modules,
                           "sim": "pdlife.sim.rank" in sys.modules}}))
        """
    )
    assert (got["torch"], got["sim"]) == (False, False), got
    assert got["rc"] == (0 if argv[0] == "diagram" else 2)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_the_backend_probe_loads_no_engine_in_the_launcher(backend, tmp_path):
    pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[backend])
    got = _python(
        f"""
        import json, os, sys
        from pdlife.cli import build_parser
        from pdlife.run.config import sim_config
        args = build_parser(["simulate"]).parse_args(
            ["simulate", "--backend", {backend!r}, "--out", {str(tmp_path)!r},
             "--waiting-timeout", "4"])
        cfg, why = sim_config(args)
        engines = [m for m in ("mooncake.engine", "nixl_cu12") if m in sys.modules]
        from pdlife.run import launch
        print(json.dumps({{"backend": cfg.backend, "engines": engines,
                           "forkable": launch.forkable(), "waiting": cfg.waiting_timeout_s}}))
        """
    )
    assert got["backend"] == backend
    assert got["engines"] == []  # it loaded in the probe's child only
    assert got["forkable"] is True  # so the ranks may fork from here
    assert got["waiting"] == 4.0  # --waiting-timeout reaches the run's config


def test_ranks_fork_from_a_launcher_without_threads_and_each_hears_the_port(tmp_path):
    got = _python(
        f"""
        import json, os
        from pathlib import Path
        from pdlife.run import launch

        class Store:  # what the ranks are told: its port
            port = 4242

        def rank(r, port, where):
            Path(where, str(r)).write_text(json.dumps([port, os.getppid()]))

        forked = launch.forkable()
        procs, store = launch.start_ranks(3, rank, ({str(tmp_path)!r},), Store, preload=[])
        for p in procs:
            p.join(60)
        print(json.dumps({{"forked": forked, "codes": [p.exitcode for p in procs],
                           "me": os.getpid()}}))
        """
    )
    assert got["forked"] is True
    assert got["codes"] == [0, 0, 0]
    for r in range(3):
        port, parent = json.loads((tmp_path / str(r)).read_text())
        assert port == 4242
        assert parent == got["me"]  # forked from the launcher, not from a fork server


def test_a_failed_store_start_leaves_no_rank_behind():
    got = _python(
        """
        import json, time
        from pdlife.run import launch

        def rank(r, port):
            time.sleep(600)

        def store():
            raise OSError("no port")

        try:
            launch.start_ranks(2, rank, (), store, preload=[])
        except OSError as e:
            said = str(e)
        import multiprocessing
        print(json.dumps({"said": said, "alive": len(multiprocessing.active_children())}))
        """
    )
    assert got == {"said": "no port", "alive": 0}


def test_a_probe_in_a_child_says_what_the_child_raised():
    got = _python(
        """
        import json, os
        from pdlife.args import UsageError
        from pdlife.run import launch

        def fine(x):
            return x * 2, os.getpid()

        def refused(x):
            raise UsageError("--backend nixl", "cannot import it (no libucs)")

        def broken(x):
            raise RuntimeError("a bug\\n second line")

        def dies(x):
            os._exit(9)

        out = {"me": os.getpid(), "fine": launch.apart(fine, 21, what="--backend x")}
        for f in (refused, broken, dies):
            try:
                launch.apart(f, 1, what="--backend x")
            except UsageError as e:
                out[f.__name__] = [e.what, str(e)]
        print(json.dumps(out))
        """
    )
    assert got["fine"][0] == 42 and got["fine"][1] != got["me"]  # it ran in a child
    assert got["refused"] == ["--backend nixl", "--backend nixl: cannot import it (no libucs)"]
    assert (
        got["broken"][0] == "--backend x" and "RuntimeError: a bug second line" in got["broken"][1]
    )
    assert got["dies"][0] == "--backend x" and "(9)" in got["dies"][1]


def test_in_a_process_with_threads_the_probe_runs_here_and_ranks_use_a_fork_server():
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()  # (a pytest worker may have none of its own)
    try:
        assert launch.forkable() is False
        assert launch.apart(os.getpid, what="x") == os.getpid()  # run here, not forked
    finally:
        stop.set()
        t.join()


def test_native_threads_of_a_big_machine_do_not_stop_the_fork():
    # numpy's BLAS and torch start a thread per core as they import or first
    # compute: on a bigger machine, more than the two seen here
    got = _python(
        """
        import json, os
        import numpy, torch
        torch.set_num_threads(4)
        torch.ones(1 << 22).sum()  # (its intra-op pool: native threads)
        from pdlife.run import launch
        print(json.dumps({"native": len(os.listdir("/proc/self/task")),
                          "forkable": launch.forkable()}))
        """
    )
    assert got["native"] > 2  # what the old count refused
    assert got["forkable"] is True


def test_a_launcher_that_loaded_an_engine_does_not_fork(monkeypatch):
    assert launch.forkable() in (True, False)  # (a pytest worker may run threads)
    monkeypatch.setattr(launch.threading, "active_count", lambda: 1)
    for m in launch.ENGINES:  # (this worker may have loaded one to see if it is there)
        monkeypatch.delitem(sys.modules, m, raising=False)
    assert launch.forkable() is True
    monkeypatch.setitem(sys.modules, "mooncake", type(sys)("mooncake"))
    assert launch.forkable() is False


def test_ranks_whose_launcher_is_gone_before_it_said_exit_at_once():
    # each forked rank closes the pipe ends it inherited, its own write end
    # included: the launcher's exit is an end of file, not a wait of WAIT_S
    got = _python(
        """
        import json, os, sys
        from pdlife.run import launch

        def store():
            print(json.dumps({"pids": [p.pid for p in procs], "forked": launch.forkable()}))
            sys.stdout.flush()
            os._exit(0)  # gone before the ranks are told the port

        procs = []
        real = launch.mp.get_context("fork").Process.start
        def start(self):
            real(self)
            procs.append(self)
        launch.mp.get_context("fork").Process.start = start
        launch.start_ranks(2, print, (), store, preload=[])
        """
    )
    assert got["forked"] is True
    deadline = time.monotonic() + launch.WAIT_S / 4  # they exit in milliseconds; old: WAIT_S

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    while any(running(pid) for pid in got["pids"]):
        assert time.monotonic() < deadline, "a rank still waits for a launcher that is gone"
        time.sleep(0.05)
