"""A JSON-lines trace of the worker's steps, for finding where a request's wait went.

`--trace-steps PATH` writes one line per step once its results are in:

    {"t0": launch, "ret": launch returned, "t1": results in, "host": exposed host s,
     "decode": rows of one token, "eager": 1 (only where a prompt step ran op by op, no
     CUDA graph for it; the overlapped loop's steps, which CUDA runs),
     "chunks": [[request id, tokens, first position, prompt length], ...],
     "new": [{"rid", "session", "received", "arrival", "admitted"}, ...]}

and, from the API, one line per request when its handler takes the first event:

    {"rid": request id, "pushed": worker pushed it to the stream, "taken": handler took it}

(lines in the order they were written: a request's first-event line may come before the line
of the step that sampled it, which the worker writes once it has handed the token over).

Times are time.monotonic() seconds (the clock of Request.arrival). `chunks` are the step's
prompt rows (a row that computes prompt tokens, recomputed ones included); the chunk whose
first position + tokens reaches the prompt length is the prompt's last, and its request's
first token is sampled by that step (t1). `new` describes each request the first time one of
its chunks runs: when the HTTP handler got it (`received`, None outside the API), when it
was submitted to the engine (`arrival`) and admitted to a batch (`admitted`). From that a
request's first-token wait splits into the API's part, the queue, the steps until its last
chunk, and (against a client's own TTFT) what streaming and the network added:
bench/trace_report.py does it for a `ds4pool bench agents` run.

Written on the worker thread, buffered; a diagnostic, off by default (a line per step is a
few hundred bytes: ~10 MB an hour at 30 steps/s).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import IO

from ds4pool.sched.step import Step


class StepTrace:
    def __init__(self, path: Path) -> None:
        self._file: IO[str] | None = path.open("a", encoding="utf-8", buffering=1 << 16)
        # the worker times steps with perf_counter: the same offset maps it onto monotonic
        self._offset = time.monotonic() - time.perf_counter()
        self._lock = threading.Lock()  # the worker's steps and the API's first events

    def step(
        self,
        step: Step,
        t_launch: float,
        t_ready: float,
        host: float,
        returned: float | None = None,
        eager: bool = False,
        launch_cpu: float | None = None,
    ) -> None:
        """One step whose results are in (after writeback advanced its rows: a row's
        num_computed already counts its chunk). perf_counter times; `returned`: when its
        launch gave the host back (None where launch and wait are one call); `eager`: a
        prompt step the runner ran op by op (no CUDA graph for it); `launch_cpu`: the step
        thread's CPU seconds in the launch call (a call much longer than that waited: for
        the GIL, or for the device)."""
        decode, chunks, new = 0, [], []
        for seq, n in zip(step.seqs, step.counts):
            prompt = len(seq.prompt_ids)
            start = seq.num_computed - n
            if start >= prompt:
                decode += 1
                continue
            rid = seq.req.request_id
            chunks.append([rid, n, start, prompt])
            if start == seq.num_reused:  # its first chunk (again, if it was preempted)
                new.append(
                    {
                        "rid": rid,
                        "session": seq.req.session_id,
                        "received": seq.req.received,
                        "arrival": seq.req.arrival,
                        "admitted": seq.admitted_at,
                    }
                )
        line: dict[str, object] = {
            "t0": round(t_launch + self._offset, 6),
            "t1": round(t_ready + self._offset, 6),
            "host": round(host, 6),
            "decode": decode,
            "chunks": chunks,
        }
        if returned is not None:
            line["ret"] = round(returned + self._offset, 6)
        if eager:
            line["eager"] = 1
        if launch_cpu is not None:
            line["cpu"] = round(launch_cpu, 6)
        if new:
            line["new"] = new
        self._write(line)

    def first_event(self, request_id: int, pushed: float | None, taken: float) -> None:
        """A request's first event: when the worker pushed it to the request's stream and
        when the HTTP handler took it (time.monotonic(); called on the event loop)."""
        self._write({"rid": request_id, "pushed": pushed, "taken": taken})

    def _write(self, line: dict[str, object]) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(text)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
