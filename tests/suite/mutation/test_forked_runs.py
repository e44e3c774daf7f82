"""``lora_suite.mutation.forked_runs``: runs forked from a server that imported packages once give what a fresh process
gives (arguments, environment, output, exit code), a run past its timeout is killed, and the server refuses to serve
where a preload imported a module under mutation or started a thread."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lora_suite.mutation.forked_runs import ForkServer, ForkServerError, run_subprocess

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork servers need os.fork (POSIX)")


def _env(tmp_path, **extra) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), **extra)


@pytest.fixture
def server(tmp_path):
    s = ForkServer(sys.executable, _env(tmp_path), ["json"], ["calc"], tmp_path / "fs")
    yield s
    s.close()


def test_a_forked_run_gives_what_a_fresh_process_gives(server, tmp_path):
    (tmp_path / "shout.py").write_text("import os, sys\nprint(sys.argv[1:], os.environ['WORD'])\nsys.exit(3)\n")
    env = _env(tmp_path, WORD="hello")
    argv = [sys.executable, "-m", "shout", "a", "b"]
    forked, fresh = server.run(argv, env, 60), run_subprocess(argv, env, 60)
    assert (forked.returncode, forked.output) == (fresh.returncode, fresh.output) == (3, "['a', 'b'] hello\n")
    argv = [sys.executable, "-c", "import os, sys; print(sys.argv[1:], os.environ['WORD'], 'json' in sys.modules)", "x"]
    forked, fresh = server.run(argv, env, 60), run_subprocess(argv, env, 60)
    assert (forked.output, fresh.output) == ("['x'] hello True\n", "['x'] hello False\n")  # json came preloaded
    unset = server.run([sys.executable, "-c", "import os; print(os.environ.get('WORD'))"], _env(tmp_path), 60)
    assert unset.output == "None\n"  # the run's environment is the one given, not the server's or the last run's


def test_a_crash_is_the_runs_exit_code_and_output(server, tmp_path):
    done = server.run([sys.executable, "-c", "raise ValueError('bad value 7')"], _env(tmp_path), 60)
    assert done.returncode == 1 and "ValueError: bad value 7" in done.output


def test_a_run_past_its_timeout_is_killed(server, tmp_path):
    start = time.perf_counter()
    done = server.run([sys.executable, "-c", "import time; time.sleep(60)"], _env(tmp_path), 1.0)
    assert done.returncode is None and time.perf_counter() - start < 10


def test_runs_from_several_threads_each_get_their_own_result(server, tmp_path):
    def one(i: int):
        return server.run(
            [sys.executable, "-c", f"import time, sys; time.sleep(0.2); sys.exit({i})"], _env(tmp_path), 60
        )

    with ThreadPoolExecutor(6) as pool:
        assert [d.returncode for d in pool.map(one, range(6))] == list(range(6))


def test_a_command_it_cannot_fork_runs_as_a_fresh_process(server, tmp_path):
    (tmp_path / "script.py").write_text("print('ran')\n")
    done = server.run([sys.executable, str(tmp_path / "script.py")], _env(tmp_path), 60)
    assert (done.returncode, done.output) == (0, "ran\n")


def test_the_server_refuses_a_preload_that_imports_a_module_under_mutation(tmp_path):
    (tmp_path / "calc.py").write_text("X = 1\n")
    (tmp_path / "heavy.py").write_text("import calc\n")
    with pytest.raises(ForkServerError, match="imported calc, the module.s. under mutation"):
        ForkServer(sys.executable, _env(tmp_path), ["heavy"], ["calc"], tmp_path / "fs")


def test_the_server_refuses_a_preload_that_starts_a_thread(tmp_path):
    (tmp_path / "spawner.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    with pytest.raises(ForkServerError, match="started threads"):
        ForkServer(sys.executable, _env(tmp_path), ["spawner"], [], tmp_path / "fs")
