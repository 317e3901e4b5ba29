"""A pool of daemon threads for questions to hosts, whose answer nobody waits for once mnft is told to stop.

concurrent.futures.ThreadPoolExecutor joins its threads when the interpreter exits, whatever `shutdown(wait=False)`
said: a thread still waiting on a host that accepts TCP and never speaks SSH (a wedged sshd, a firewall answering the
SYN) holds Ctrl-C up for its whole connect timeout. `DaemonPool` has the same `submit` and `shutdown` but daemon
threads: what the main thread still waits for it gets; what nobody waits for any more is abandoned at exit.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class DaemonPool:
    """At most `max_workers` daemon threads, started as work comes; `submit` gives a Future (as an Executor's)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "mnft") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            self._queue.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever waits
                    future.set_exception(exc)
                del future, fn, args, kwargs, item
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """No more work; the work not started is cancelled (cancel_futures); the running work goes on, abandoned
        at exit if nobody waits for it (wait=True: waited for here)."""
        with self._lock:
            self._shutdown = True
            pending = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item)
            for item in pending:
                if cancel_futures:
                    item[0].cancel()
                else:
                    self._queue.put(item)
            for _ in self._threads:
                self._queue.put(None)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
