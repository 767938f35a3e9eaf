"""bench/pyspy_steps.py: the step thread's state in its slow launches, from a py-spy chrome
trace lined up with the server's --trace-steps file."""

from __future__ import annotations

from bench import pyspy_steps

STEP = [("Worker._run", "ds4pool/sched/worker.py"), ("ModelRunner.launch", "runner.py")]
GIL_WAIT = [("pybind11::gil_scoped_release::~gil_scoped_release", "libtorch_python.so"),
            ("pthread_cond_timedwait", "libc.so.6")]  # fmt: skip
RUN = [("LlamaDecoderLayer.forward", "ds4pool/model/llama.py")]
DRIVER = [("cudaLaunchKernel", "libcudart.so"), ("0x7f00", "libcuda.so.1")]


def spans(tid: int, label: str, parts: list[tuple[float, float, list[tuple[str, str]]]]):
    """py-spy's chrome events for one thread: each part a stack held from start to end (s)."""
    events = []
    for start, end, frames in parts:
        stack = [(label, "")] + frames
        for name, file in stack:
            events.append({"ph": "B", "tid": tid, "ts": start * 1e6, "name": name,
                           "args": {"filename": file}})  # fmt: skip
        for name, file in reversed(stack):
            events.append({"ph": "E", "tid": tid, "ts": end * 1e6, "name": name,
                           "args": {"filename": file}})  # fmt: skip
    return events


def test_a_slow_launch_is_split_into_gil_driver_and_running_with_whoever_ran_meanwhile():
    step_thread = "thread (11): ds4pool-worker"
    events = spans(1, step_thread, [
        (1.000, 1.060, STEP + GIL_WAIT),  # 60 ms taking the GIL back
        (1.060, 1.080, STEP + DRIVER),
        (1.080, 1.100, STEP + RUN),
        (2.000, 2.030, STEP + RUN),  # a quick launch
        (3.000, 3.020, STEP + RUN),
    ])  # fmt: skip
    events += spans(2, "thread (10): MainThread", [
        (1.000, 1.050, [("Runner.run", "runners.py"), ("chat_completions", "api/openai.py")]),
        (1.050, 1.100, [("EpollSelector.select", "selectors.py"), ("epoll_wait", "libc.so.6")]),
    ])  # fmt: skip
    events += spans(3, "thread (12): ds4pool-tokenize", [
        (1.000, 1.100, [("Condition.wait", "threading.py"), ("0x7f01", "libc.so.6")]),
    ])  # fmt: skip
    off = 500.0  # the trace's monotonic clock against py-spy's
    steps = [
        {"t0": off + 1.0, "ret": off + 1.1, "t1": off + 1.12, "eager": 1, "cpu": 0.04,
         "decode": 2, "chunks": [[1, 200, 0, 400], [2, 243, 0, 243]]},
        {"t0": off + 2.0, "ret": off + 2.03, "t1": off + 2.05, "eager": 1, "decode": 0,
         "chunks": [[3, 100, 0, 100]]},
        {"t0": off + 3.0, "ret": off + 3.02, "t1": off + 3.04, "decode": 8, "chunks": []},
    ]  # fmt: skip
    res = pyspy_steps.analyse(events, steps, min_ms=60)
    assert abs(res["offset_s"] - off) < 1e-6
    assert res["eager_launches"] == 2  # the decode-only step is not an eager launch
    (slow,) = res["slow"]
    assert round(slow["launch_ms"]) == 100 and round(slow["cpu_ms"]) == 40
    states = {k: round(v) for k, v in slow["state_ms"].items()}
    assert states == {"gil": 60, "driver": 20, "run": 20}
    # while it waited, only the event loop ran (50 of the 60 ms); the blocked threads do not count
    assert {k: round(v) for k, v in slow["others_ms"].items()} == {
        "MainThread: chat_completions (openai.py)": 50
    }
    text = pyspy_steps.report(res, 60)
    assert "| 100.0 | 40.0 | 2 | 2 | gil 60.0, driver 20.0, run 20.0 |" in text
    assert {k: round(v) for k, v in res["eager_state_ms"].items()} == {
        "gil": 60,
        "driver": 20,
        "run": 50,
    }
