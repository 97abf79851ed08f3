"""Generation requests from many threads, answered by one engine call at a time.

Workflows run a thread per task (and more where a workflow runs its samples side by side),
each blocking in `generate` while the engine works. The batcher's own thread waits until every
registered participant is waiting, or `max_wait_s` has passed since the oldest request (a
participant busy elsewhere, say on a slow tool), then sends every waiting request to the
engine as one call, sorted by the callers' `order` keys: the batch's make-up and order, hence
its samples under a seed, do not depend on thread timing. Callers that never registered (the
HTTP server's requests) go with whatever is waiting when the engine is free.

Only one thread touches the engine, so engines need not be thread-safe. An `inline` batcher
has no thread of its own: `explore` answers its batches on the thread that explores (the
explorer's, or a colocated trainer's), so every torch computation of a process stays on one
thread. Torch on a second thread runs ~30 % slower on a CPU: each thread has its own OpenMP
team, and the idle team's spinning workers take cores from the busy one. A threaded batcher
(the HTTP server's, whose callers come and go) runs with the torch thread count of the thread
that made it: a new thread would otherwise compute with the OpenMP default, which
OMP_NUM_THREADS sets (Ray sets 1 in its workers) whatever `torch.set_num_threads` said
elsewhere, and `torch.get_num_threads()` would not show it; `exclusive` holds it between
batches (to load new weights) and sets the `tag` (the policy version) that `generate_tagged`
reports with each batch's samples.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from reservoir.explorer.engine import Done, Engine, Request, Sample


@dataclass
class _Job:
    requests: Sequence[Request]
    order: tuple
    since: float = field(default_factory=time.monotonic)
    result: Future = field(default_factory=Future)


class Batcher:
    def __init__(self, engine: Engine, *, max_wait_s: float = 0.5, inline: bool = False) -> None:
        self.engine, self.max_wait_s, self.inline = engine, max_wait_s, inline
        self._lock = threading.Condition()
        self._jobs: list[_Job] = []
        self._participants = 0
        self._closed = False
        self._busy = threading.Lock()  # held while the engine generates (or is held)
        self._threads = torch.get_num_threads()
        self._callers: ThreadPoolExecutor | None = None
        self._callers_size = 0
        self.tag = None
        self._thread = None
        if not inline:
            self._thread = threading.Thread(target=self._serve, name="batcher", daemon=True)
            self._thread.start()

    def join(self, n: int = 1) -> None:
        """`n` more threads will call `generate`; each calls `leave` when it is done."""
        with self._lock:
            self._participants += n

    def leave(self) -> None:
        with self._lock:
            self._participants -= 1
            self._lock.notify_all()

    @contextmanager
    def away(self):
        """The calling participant waits on something else (its own helpers) meanwhile."""
        self.leave()
        try:
            yield
        finally:
            self.join()

    def generate(self, requests: Sequence[Request], order: tuple = ()) -> list[list[Sample]]:
        """Each request's samples, generated in the next batch; blocks until then."""
        return self.generate_tagged(requests, order)[0]

    def generate_tagged(self, requests: Sequence[Request], order: tuple = ()):
        """(each request's samples, the tag the engine had when it generated them)."""
        job = _Job(list(requests), order)
        with self._lock:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._jobs.append(job)
            if len(self._jobs) == 1 or len(self._jobs) >= self._participants:
                self._lock.notify_all()  # the first starts the wait, the last ends it
        return job.result.result()

    def generate_round(self, requests: Sequence[Request], order: tuple = (),
                       on_done: Done | None = None) -> list[list[Sample]]:
        """A whole round's requests in one call by one caller (a workflow's `round`): on an
        inline batcher's own thread the engine runs now, on this thread, and `on_done` hears
        of each request as the engine finishes it; otherwise they are one participant's batch
        like any other, and `on_done` hears of them all when it is answered."""
        if self.inline:
            with self._busy:
                return self.engine.generate(requests, on_done=on_done)
        self.join()
        try:
            samples = self.generate(requests, order)
        finally:
            self.leave()
        for index, each in enumerate(samples if on_done is not None else ()):
            on_done(index, each)
        return samples

    @contextmanager
    def exclusive(self):
        """The engine to the caller alone, between two batches."""
        with self._busy:
            yield self.engine

    def hold(self) -> None:
        """Keep the engine from every batch until `let_go` (a colocated trainer holds it
        while it trains, and lets its server's calls generate between steps)."""
        self._busy.acquire()

    def let_go(self) -> None:
        self._busy.release()

    def callers(self, threads: int) -> ThreadPoolExecutor:
        """Threads for the batcher's callers (workflows), kept from one round to the next:
        starting a thread costs about 0.4 ms when many start at once."""
        if self._callers is None or self._callers_size < threads:
            if self._callers is not None:
                self._callers.shutdown()
            self._callers = ThreadPoolExecutor(threads, thread_name_prefix="workflow")
            self._callers_size = threads
        return self._callers

    def close(self) -> None:
        """Answer what is waiting, then stop the batcher's threads."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._callers is not None:
            self._callers.shutdown()

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serve_inline(self, futures: list[Future]) -> None:
        """Answer batches on the calling thread until every one of `futures` (the workflows of
        an inline batcher's round) is done; one waiting on something else meanwhile (`away`)
        may generate again."""
        for future in futures:
            future.add_done_callback(lambda _: self._wake())
        running = lambda: not all(future.done() for future in futures)  # noqa: E731
        while (jobs := self._take(running)) is not None:
            self._answer(jobs)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _take(self, running: Callable[[], bool] | None = None) -> list[_Job] | None:
        """The next batch once it is due; None when closed with nothing left (or, for an
        inline round, when nothing waits and `running()` says the round is over)."""
        with self._lock:
            while True:
                if running is not None and not self._jobs and not running():
                    return None
                if self._jobs:
                    waited = time.monotonic() - self._jobs[0].since
                    if self._closed or len(self._jobs) >= self._participants \
                            or waited >= self.max_wait_s:
                        jobs, self._jobs = self._jobs, []
                        return sorted(jobs, key=lambda job: job.order)
                    self._lock.wait(self.max_wait_s - waited)
                elif self._closed:
                    return None
                else:
                    self._lock.wait()

    def _serve(self) -> None:
        torch.set_num_threads(self._threads)
        while (jobs := self._take()) is not None:
            self._answer(jobs)

    def _answer(self, jobs: list[_Job]) -> None:
        """One engine call for the jobs' requests; each job gets its share (or the error)."""
        requests = [request for job in jobs for request in job.requests]
        try:
            with self._busy:
                tag, samples = self.tag, self.engine.generate(requests)
        except BaseException as exc:  # every caller of this batch sees the engine's error
            for job in jobs:
                job.result.set_exception(exc)
            return
        start = 0
        for job in jobs:
            job.result.set_result((samples[start:start + len(job.requests)], tag))
            start += len(job.requests)
