"""`bench serve`'s CPU accounting: the seconds each process of the server's session used,
which is how the report shows the load generator and the server sharing the cores."""

import subprocess
import sys
import time

from matrixinfer.bench.serve_bench import _cpu_table, session_cpu_seconds


def test_session_cpu_counts_a_busy_server_process_and_not_others():
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", busy], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while sum(session_cpu_seconds(proc.pid).values()) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        (name, seconds), = session_cpu_seconds(proc.pid).items()  # only that session's one process
        assert name.startswith("python") and 0.25 <= seconds < 5
        assert session_cpu_seconds(2**22 + 17) == {}  # no such session
    finally:
        proc.kill()
        proc.wait(10)


def test_cpu_table_lists_each_server_and_rate():
    rows = [{"offered_rate": float("inf"), "duration_s": 1.5,
             "cpu_s": {"load generator": 0.4, "engine-core": 2.1, "python": 0.3}}]
    table = _cpu_table([("matrixinfer", rows), ("vLLM 0", [{"offered_rate": 2.0, "duration_s": 9.0}])])
    assert table.splitlines()[2] == "| matrixinfer | all at once | 1.5 | engine-core 2.10, load generator 0.40, python 0.30 |"
    assert len(table.splitlines()) == 3  # a run without accounting adds no row


def test_offline_reference_times_each_request_as_a_client_does():
    """The offline reference's per-request TPOT spans a request's first to last token (as a
    served TPOT does, so steps that prefill other requests would count): one value per
    request, about the decode step when all prefill together, and no longer than the run."""
    from matrixinfer.bench.engine_bench import run_matrixinfer
    from matrixinfer.config import DEFAULT_MODEL

    n = 6
    run = run_matrixinfer(DEFAULT_MODEL, "float32", [list(range(10, 26)), list(range(30, 46))], n, False,
                          enforce_eager=True, per_request_tpot=True)
    run.llm.shutdown()
    assert len(run.tpot_s) == 2
    assert 0 < run.prefill_s < run.seconds  # the engine bench's prefill column: both prompts through prefill
    for tpot in run.tpot_s:
        assert 0.5 * run.decode_step_s <= tpot and tpot * (n - 1) <= run.seconds
