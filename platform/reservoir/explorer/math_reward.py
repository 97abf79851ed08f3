"""`math_verify`: a math answer checked by the math-verify library (LaTeX, fractions, sets,
intervals, boxed answers), with a timeout per call.

math-verify bounds its own parsing and comparing with SIGALRM, which only works in a process's
main thread, while explorers score in workflow threads. So each call runs in a small pool of
worker processes (spawned once per explorer, math-verify imported there), where it is the main
thread and its own timeouts hold; a call that still overruns `timeout_s` (options) gives up,
and the pool is replaced.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor, TimeoutError as CallTimeout

from reservoir.explorer.rewards import Components, Context

WORKERS = 2
DEFAULT_TIMEOUT_S = 5.0

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()


def verify_answer(response: str, answer: str, timeout_s: float) -> bool:
    """Whether the response's final answer equals the gold one (in the calling process)."""
    from math_verify import parse, verify

    seconds = max(1, int(timeout_s))
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$",
                 parsing_timeout=seconds)
    found = parse(response, parsing_timeout=seconds)
    return bool(gold and found and verify(gold, found, timeout_seconds=seconds))


def _executor() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def _replace(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()  # a call stuck past its timeout: its worker goes
    pool.shutdown(wait=False, cancel_futures=True)


def math_verify(response: str, answer: str, *, context: Context = Context()) -> Components:
    """1 when math-verify finds the response's answer equal to the task's (e.g. `\\frac{1}{2}`
    and `0.5`, `\\{1, 2\\}` and `\\{2, 1\\}`), else 0."""
    timeout_s = float(context.options.get("timeout_s", DEFAULT_TIMEOUT_S))
    pool = _executor()
    future = pool.submit(verify_answer, response, answer, timeout_s)
    try:
        return {"accuracy": float(future.result(timeout=2 * timeout_s + 5))}
    except CallTimeout:
        _replace(pool)
        raise TimeoutError(f"math-verify took over {2 * timeout_s + 5:g} s") from None
