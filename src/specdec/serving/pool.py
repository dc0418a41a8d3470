"""A pool of decoder workers for the server: N threads, one forked decoder each, one bounded wait queue.

Every worker's decoder is ``decoder.fork()`` of one loaded decoder: all share ONE set of onnxruntime
sessions (the weights are in memory once) and own their KV caches and IO bindings, so N concurrent
streams cost N caches, not N models. A request is a *job*: a function ``work(decoder)`` returning an
iterator (e.g. ``decoder.stream(...)``); the worker forwards each item to the job's asyncio queue.
Cancelling a job (client gone, shutdown) makes its worker close the iterator after the current item
(``decoder.stream`` stops between rounds) and take the next job.

Routing: jobs start in arrival order; a job that names its prompt's token ids goes to the free worker
whose KV cache already holds the longest prefix of them (``decoder.cached_prefix``), so a conversation's
next turn, or an editor's next infill on the same file, computes only what is new. A job *pinned* to a worker
(``submit(..., worker=i)``: llama-server's ``id_slot``, a slot's save / restore / erase) waits for that worker
and runs on no other, after what it is running now: a slot action never races a generation. Each worker
remembers its last job (``last_jobs``: what ``GET /slots`` reports).

Pass costs measured beside other work (a start under an editor or a test runner: ``decoder.costs_noisy``) are
measured again once the pool has had no job for ``IDLE_BEFORE_REFINE`` seconds: every worker is held meanwhile, a
job that arrives stops the measurement before its next timed pass, and the result (kept only if the CPU was quieter)
goes to every worker and to the store, so later starts read it. A server's first start on a machine runs on
provisional costs (``decoder.costs(provisional=True)``: a coarse measurement, never stored); their full measurement
waits only ``IDLE_BEFORE_FIRST_COSTS`` seconds without a job, the same way. Boundary: no HTTP here (jobs.py and the
dialects).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


class PoolBusy(RuntimeError):
    """Every worker is busy and the wait queue is full (HTTP 429)."""


class PoolClosed(RuntimeError):
    """The pool is shutting down and takes no new jobs (HTTP 503)."""


class JobCancelled(RuntimeError):
    """The job was cancelled (client disconnect or shutdown) before it finished."""


@dataclass(frozen=True)
class PoolOptions:
    workers: int = 1  # concurrent generations (each a KV cache; the sessions are shared)
    max_queue: int = 16  # requests that may wait for a worker; more are refused (429)

    def __post_init__(self):
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")


END = object()  # what Job.get returns after the last item
REFINING = object()  # what a worker holds while an idle pool measures noisy pass costs again (no job is given it)
IDLE_BEFORE_REFINE = 30.0  # seconds without a job before an idle pool measures noisy pass costs again
IDLE_BEFORE_FIRST_COSTS = 2.0  # and before it measures provisional ones in full (a first start's)
REFINE_POLL = 5.0  # how often the pool looks whether it may


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Job:
    """One request's work and the asyncio side of its results."""

    def __init__(self, work: Callable[[object], Iterator], loop: asyncio.AbstractEventLoop,
                 prompt_ids: Sequence[int] | None = None, pinned: int | None = None, task_id: int = 0):
        self.work = work
        self.loop = loop
        self.prompt_ids = prompt_ids  # for routing to the worker whose cache shares the most (None: any)
        self.pinned = pinned  # the only worker that may run it (None: any)
        self.task_id = task_id  # the pool's serial number of this job (llama-server's id_task)
        self.worker: int | None = None  # the index of the worker that took it
        self.request = None  # what the submitter wants /slots to see of it (serving/jobs.py: its Prepared)
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()
        self.started: float | None = None  # when a worker took it

    def cancel(self) -> None:
        self.cancelled.set()

    async def get(self):
        """The next item, or ``END`` after the last; the worker's exception (or JobCancelled) is raised here."""
        item = await self.items.get()
        if item is END or isinstance(item, _Failure):
            self.items.put_nowait(item)  # stay at the end for any later call
            if item is not END:
                raise item.error
        return item

    def _put(self, item) -> None:  # from the worker thread
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class DecoderPool:
    """``options.workers`` threads, each with its own fork of ``decoder``; jobs start in arrival order, each on
    the free worker whose cache holds the longest prefix of its prompt."""

    def __init__(self, decoder, options: PoolOptions | None = None):
        self.options = options or PoolOptions()
        self.decoder = decoder
        self.decoders = [decoder] + [decoder.fork() for _ in range(self.options.workers - 1)]
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: deque = deque()  # jobs not yet given to a worker, oldest first
        self._assigned: list = [None] * len(self.decoders)  # worker index -> its job (None: free)
        self._wake = [threading.Condition(self._lock) for _ in self.decoders]
        self._stopping = False
        self._active: set = set()
        self.waiting = 0  # jobs queued, not yet taken by a worker
        self.busy = 0  # workers running a job
        self.closed = False
        self.cancelled_jobs = 0
        self.routed_to_cache = 0  # jobs given to a worker whose cache already held part of their prompt
        self.last_jobs: list = [None] * len(self.decoders)  # worker index -> the job it runs or ran last
        self._tasks = 0  # jobs submitted so far (each job's task_id)
        self._last_job = time.monotonic()  # when a job was last submitted or ended
        self._closing = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"specdec-worker-{i}", daemon=True)
                         for i in range(len(self.decoders))]
        self._threads.append(threading.Thread(target=self._refine_when_idle, name="specdec-refine", daemon=True))
        for thread in self._threads:
            thread.start()

    def submit(self, work: Callable[[object], Iterator], loop: asyncio.AbstractEventLoop | None = None,
               prompt_ids: Sequence[int] | None = None, worker: int | None = None, request=None) -> Job:
        """Queue ``work``; PoolBusy when every worker is busy and ``max_queue`` jobs already wait.
        ``prompt_ids``: the request's prompt, to route it to the free worker that has most of it cached;
        ``worker``: the index of the one worker that must run it (it waits for that worker; None: any);
        ``request``: what ``last_jobs`` shows of it (``Job.request``)."""
        if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int)
                                   or not 0 <= worker < len(self.decoders)):
            raise ValueError(f"worker must be an index in 0..{len(self.decoders) - 1}, got {worker!r}")
        job = Job(work, loop or asyncio.get_running_loop(), prompt_ids, worker)
        job.request = request
        with self._lock:
            if self.closed:
                raise PoolClosed("the server is shutting down")
            if self.waiting + self.busy >= self.options.workers + self.options.max_queue:
                raise PoolBusy(f"all {self.options.workers} workers are busy and {self.waiting} requests wait "
                               f"(--max-queue {self.options.max_queue})")
            self._tasks += 1
            self._last_job = time.monotonic()
            job.task_id = self._tasks
            self.waiting += 1
            self._active.add(job)
            self._pending.append(job)
            self._dispatch()
        return job

    def _dispatch(self) -> None:
        """Give pending jobs, oldest first, to free workers: a pinned job to its worker once that one is free (it
        lets younger jobs pass meanwhile), any other to the free worker sharing the longest prompt prefix (the
        lowest index on a tie). Called with the lock held; a free worker's decoder is idle, so asking its cache is
        safe."""
        if self._stopping:
            return
        for job in list(self._pending):
            free = [i for i, held in enumerate(self._assigned) if held is None]
            if not free:
                return
            if job.pinned is not None:
                if job.pinned not in free:
                    continue
                best = job.pinned
            else:
                shared = {i: self._cached_prefix(i, job.prompt_ids) for i in free}
                best = max(free, key=lambda i: (shared[i], -i))
                self.routed_to_cache += shared[best] > 0
            self._pending.remove(job)
            job.worker = best
            self._assigned[best] = job
            self.last_jobs[best] = job
            self._wake[best].notify()

    def worker_states(self) -> list:
        """Per worker: (whether it runs a job now, the job it runs or ran last, or None)."""
        with self._lock:
            return [(held is not None, last) for held, last in zip(self._assigned, self.last_jobs)]

    def _cached_prefix(self, index: int, prompt_ids) -> int:
        if not prompt_ids:
            return 0
        held = getattr(self.decoders[index], "cached_prefix", None)
        try:
            return int(held(prompt_ids)) if held is not None else 0
        except Exception:  # routing is a preference: a decoder that cannot say counts as holding nothing
            return 0

    def _serve(self, index: int) -> None:
        decoder = self.decoders[index]
        while True:
            with self._lock:
                while self._assigned[index] in (None, REFINING) and not self._stopping:
                    self._wake[index].wait()
                job = self._assigned[index]
                if job is None or job is REFINING:
                    return
                self.waiting -= 1
                self.busy += 1
            job.started = time.monotonic()
            last = _Failure(RuntimeError("the worker stopped without an answer"))
            try:
                last = self._run(job, decoder)
            finally:
                try:
                    with self._lock:
                        self.busy -= 1
                        self._last_job = time.monotonic()
                        self._active.discard(job)
                        self._assigned[index] = None
                        self._idle.notify_all()
                        self._dispatch()
                finally:
                    # Only now, with the worker free: a client that sends its next request the moment this one
                    # ends (a chat's next turn) is routed to the worker that holds its cache, not to another.
                    job._put(last)

    def _run(self, job: Job, decoder):
        """Forward the job's items; return what ends it (END or a _Failure), which _serve delivers once
        the worker is free."""
        if job.cancelled.is_set():
            self._count_cancel()
            return _Failure(JobCancelled("cancelled before it started"))
        try:
            # work that sends items from inside one blocking step (a prefill's progress) says so: it gets the put
            items = job.work(decoder, job._put) if getattr(job.work, "emits", False) else job.work(decoder)
            stopped = False
            try:
                for item in items:
                    job._put(item)
                    if job.cancelled.is_set():
                        stopped = True
                        break
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()  # a generator stops here, between rounds, and releases the decoder
            if stopped:
                self._count_cancel()
                return _Failure(JobCancelled("cancelled"))
            return END
        except Exception as exc:  # reported to the request, never kills the worker
            return _Failure(exc)

    def _refine_when_idle(self) -> None:
        """While the decoder's pass costs are provisional or noisy: once no job has run for
        ``IDLE_BEFORE_FIRST_COSTS`` / ``IDLE_BEFORE_REFINE`` seconds, hold every worker and measure them again
        (``decoder.refine_costs``), stopping at once for a job that arrives."""
        while not self._closing.wait(REFINE_POLL):
            if not getattr(self.decoder, "costs_to_refine", False):
                continue
            idle = IDLE_BEFORE_FIRST_COSTS if self.decoder.costs_provisional else IDLE_BEFORE_REFINE
            with self._lock:
                if (self.closed or self._pending or any(held is not None for held in self._assigned)
                        or time.monotonic() - self._last_job < idle):
                    continue
                self._assigned = [REFINING] * len(self.decoders)
            try:
                costs = self.decoder.refine_costs(stop=lambda: bool(self._pending) or self._closing.is_set())
                if costs is not None:
                    for worker in self.decoders[1:]:
                        worker.use_costs(costs, self.decoder.costs_other_cores)
            except Exception as exc:  # a preference: never stops the pool
                log.warning("measuring pass costs again failed: %s", exc)
            finally:
                with self._lock:
                    self._assigned = [None] * len(self.decoders)
                    self._last_job = time.monotonic()
                    self._dispatch()

    def _count_cancel(self) -> None:
        with self._lock:
            self.cancelled_jobs += 1

    def close(self, grace: float = 10.0) -> None:
        """Refuse new jobs; let running and queued ones finish for ``grace`` seconds, cancel the rest; stop."""
        self._closing.set()
        with self._lock:
            self.closed = True
            deadline = time.monotonic() + grace
            while self._active and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            for job in self._active:
                job.cancel()
            while self._pending:  # never started: answered here, no worker will take them
                job = self._pending.popleft()
                self.waiting -= 1
                self.cancelled_jobs += 1
                self._active.discard(job)
                job._put(_Failure(JobCancelled("cancelled before it started")))
            self._stopping = True
            for wake in self._wake:
                wake.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)
