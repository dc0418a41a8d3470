"""A generating request as a pool job, and its items back to the HTTP side (every dialect's routes use this).

``Prepared`` is a validated request: the prompt's token ids and its ``GenerationOptions`` (checked by the
decoder's own ``validate`` before the job is queued, so a refusal is a 400, not a broken stream). The job a
worker runs (``stream_work``) yields ``Piece``s (text, with the logprobs and token sources committed since the
previous piece; with ``Prepared.progress`` the prefill's ``PrefillProgress`` reports first) and ends with a
``Done`` (the request's statistics, the finish reason). ``Engine`` queues a job on the worker whose KV cache
holds the most of its prompt, waits for its first item, and gives its items back as one answer (``collect``) or as
a stream (``events``); a client that goes away cancels the job. Boundary: decoder options and pool jobs in, items
out; no wire shapes here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from fastapi import Request

from specdec.decoding.options import GenerationOptions
from specdec.decoding.request import GenerationStats, PrefillProgress
from specdec.serving.metrics import Metrics
from specdec.serving.pool import END, DecoderPool, JobCancelled, PoolBusy, PoolClosed
from specdec.serving.wire import DRAFT_ROOM, APIError, ClientGone, option_error

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.25


@dataclass
class Prepared:
    """A validated request: the prompt's token ids and the decoder options."""
    prompt_ids: list
    options: GenerationOptions
    time_limit: float = 0.0  # seconds after the first token; stops at the next newline past it (0: none)
    sources: bool = False  # pieces carry which proposer each token came from (``Piece.spans``)
    worker: int | None = None  # the one worker that must run it (llama-server's id_slot; None: routed)
    progress: bool = False  # the prefill's ``PrefillProgress`` reports come first (llama-server's return_progress)
    # filled by the worker as the request runs (GET /slots reads it): once the job's first item is out, the
    # prefill's counts (``prompt_tokens``, ``cached_tokens``) are final (what a stream's opening event reports)
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Piece:
    """A text piece, with what the tokens committed since the previous piece carry: their logprobs (with
    ``logprobs``) and, with ``Prepared.sources``, the piece's text split by the source of its tokens."""
    text: str
    logprobs: list | None = None
    spans: list | None = None  # [(text, source)], concatenating to ``text``; source: "draft" | "suffix" | ... | "target"
    token_ids: list = field(default_factory=list)  # the tokens committed since the previous piece


@dataclass
class Done:
    """The last item of a job: the request's statistics and the decoder's finish reason."""
    stats: GenerationStats
    queue_seconds: float
    finish: str = "length"  # the decoder's reason: "eos" | "stop" | "length"; or "time" (the time limit)
    last_token: int | None = None
    logprobs: list | None = None  # with logprobs: the entries no Piece carried (the end token's excluded)
    output_ids: list = field(default_factory=list)  # every token generated (the end token included)
    stop_string: str | None = None  # the stop string the text ended at (finish "stop" by a stop string)
    cache_tokens: int = 0  # tokens the worker's target cache holds once it ended (llama-server's tokens_cached)


def piece_text(item) -> str:
    return item.text if isinstance(item, Piece) else item


class SourceSpans:
    """Splits emitted text by the proposer of the tokens it came from (``token_sources``).

    The tokens are decoded as the decoder's own text path decodes them (``IncrementalDecoder``'s window, fed one
    token at a time as ``StopStrings`` is), so the tokenizer's rules hold (a SentencePiece word's leading space, a
    special token's empty text) and the emitted text is a prefix of what they decode to. A character belongs to
    the token that completes it: after each token, the window's text up to a trailing incomplete character is
    that token's. End tokens (EOS, a stop id: ``end_ids``) add no text, as in ``RequestState.commit``. Text the
    decoder held back to the end (an incomplete character, given out by its final flush) belongs to the first
    token still holding it. Created only when a request asks for sources: without them no span work runs."""

    def __init__(self, codec, end_ids=frozenset()):
        self.codec = codec
        self.end_ids = frozenset(end_ids)
        self.ids: list = []  # the tokens that decode to text (end tokens left out)
        self.prefix_offset = self.read_offset = 0  # IncrementalDecoder's window over ``ids``
        self.prefix = ""  # what ids[prefix_offset:read_offset] decode to
        self.given = 0  # characters after the window's prefix already given to a token
        self.queue: deque = deque()  # [characters, source] not yet matched to emitted text
        self.seen = 0  # tokens read so far
        self.holding = None  # the source of the first token of a pending incomplete character

    def _push(self, token: int, source: str) -> None:
        self.ids.append(token)
        text = self.codec.decode(self.ids[self.prefix_offset:])[len(self.prefix):]
        complete = len(text.rstrip("\ufffd"))
        if complete > self.given:
            self.queue.append([complete - self.given, source])
            self.given = complete
        if complete < len(text):
            self.holding = self.holding or source
        else:
            self.holding = None
            if text:  # IncrementalDecoder moves its window here: so does this one
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self.prefix = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
                self.given = 0

    def split(self, text: str, token_ids: list, sources: list) -> list:
        """``text`` (the next emitted piece) as [(text, source)], adjacent equal sources merged."""
        for index in range(self.seen, len(token_ids)):
            if token_ids[index] not in self.end_ids:
                self._push(token_ids[index], sources[index])
        self.seen = len(token_ids)
        spans, at = [], 0
        while at < len(text):
            if self.queue:
                head = self.queue[0]
                size, source = min(head[0], len(text) - at), head[1]
                head[0] -= size
                if not head[0]:
                    self.queue.popleft()
            else:  # the decoder's final flush: the held-back text of the tokens still holding it
                size, source = len(text) - at, self.holding or "target"
            spans.append((text[at : at + size], source))
            at += size
        return merge_spans(spans)


def merge_spans(spans) -> list:
    """[(text, source)] with adjacent equal sources joined (a piece's, or a whole answer's from its pieces')."""
    runs: list = []  # [[texts], source]: joined once at the end, not copied at every merge
    for text, source in spans:
        if runs and runs[-1][1] == source:
            runs[-1][0].append(text)
        else:
            runs.append([[text], source])
    return [("".join(texts), source) for texts, source in runs]


def stream_work(prepared: Prepared, codec):
    """The job a worker runs: the decoder's stream as ``Piece``s, then the request's ``Done``."""

    def run(decoder, emit=None):
        stats = prepared.stats
        options = prepared.options
        reports = {"on_prefill": emit} if emit is not None else {}
        stream = decoder.stream(prepared.prompt_ids, options, stats=stats, **reports)
        finish, first_piece, newline = None, None, False
        with_logprobs = options.logprobs is not None
        ends = set(decoder.eos_ids) | set(options.stop_token_ids)
        spans = SourceSpans(codec, ends) if prepared.sources else None
        sent = given = 0  # logprob entries, token ids handed out so far

        def answer_logprobs() -> list:
            """The logprobs so far, without a final end-of-turn token (not part of the answer)."""
            entries, ids = stream.logprobs, stream.token_ids
            if stream.finish_reason in ("eos", "stop") and ids and ids[-1] in ends:
                entries = entries[:-1]
            return entries

        try:
            for text in stream:
                piece = Piece(text, token_ids=list(stream.token_ids[given:]))
                given += len(piece.token_ids)
                if with_logprobs:
                    entries = answer_logprobs()
                    piece.logprobs, sent = entries[sent:], len(entries)
                if spans is not None:
                    piece.spans = spans.split(text, stream.token_ids, stream.sources)
                yield piece  # closing this job closes the stream (finally): the request stops between rounds
                if prepared.time_limit:  # llama.cpp's t_max_predict_ms: past the limit, end at a newline
                    first_piece = first_piece or time.monotonic()
                    newline = newline or "\n" in text
                    if newline and time.monotonic() - first_piece >= prepared.time_limit:
                        finish = "time"
                        break
        finally:
            stream.close()
        ids = list(stream.token_ids)
        rest = answer_logprobs()[sent:] if with_logprobs else None
        yield Done(stats, 0.0, finish or stream.finish_reason or "length", ids[-1] if ids else None, rest, ids,
                   getattr(stream, "stop_string", None), getattr(getattr(decoder, "target", None), "length", 0))

    run.emits = prepared.progress  # the pool hands it the job's put: reports go out as the prefill runs
    return run


class Engine:
    """What every generating route shares: validation through the decoder, the pool, the items back. ``pool``: None
    while the bundle loads (the app answers 503 meanwhile: serving/app.py), given once by ``attach``."""

    def __init__(self, pool: DecoderPool | None, options, metrics: Metrics):
        self.pool, self.options, self.metrics = pool, options, metrics

    def attach(self, pool: DecoderPool) -> None:
        self.pool = pool

    @property
    def ready(self) -> bool:
        return self.pool is not None

    @property
    def decoder(self):
        return self.pool.decoder

    @property
    def codec(self):
        return self.decoder.codec

    def open_budget(self, prompt_ids: list) -> int:
        """The token budget of a request that leaves it to the server: what the context holds after the prompt."""
        return max(1, self.decoder.max_context - len(prompt_ids) - 1 - DRAFT_ROOM)

    def slot(self, id_slot: int) -> int | None:
        """The worker llama-server's ``id_slot`` names (-1: None, the pool routes the request); a slot past the
        workers is a 400 naming the field."""
        workers = self.pool.options.workers
        if id_slot == -1:
            return None
        if id_slot >= workers:
            raise APIError(400, f"id_slot: must be -1 or a slot id in 0..{workers - 1}", param="id_slot")
        return id_slot

    def prepare(self, prompt_ids: list, options: GenerationOptions, names: dict, budget_given: bool = True,
                sources: bool = False, prompt_field: str | None = None, worker: int | None = None,
                progress: bool = False) -> Prepared:
        """The decoder's own checks (``make_request``) on these options; a refusal is a 400 naming the field.
        ``worker``: the one worker that must run it (None: the pool routes it). A request that gives no seed takes
        the server's (``ServerOptions.seed``), if it has one."""
        if options.seed is None and getattr(self.options, "seed", None) is not None:
            options = options.replace(seed=self.options.seed)
        try:
            self.decoder.validate(prompt_ids, options)
        except ValueError as exc:
            raise option_error(exc, names, budget_given, prompt_field) from None
        return Prepared(list(prompt_ids), options, sources=sources, worker=worker, progress=progress)

    def submit(self, work, **where):
        """``pool.submit(work, **where)``; a full queue is a 429, a pool shutting down a 503 (with Retry-After)."""
        retry = self.options.retry_after
        try:
            return self.pool.submit(work, **where)
        except PoolBusy as exc:
            raise APIError(429, f"server busy: {exc}; retry later", code="queue_full", kind="rate_limit_error",
                           retry_after=retry) from None
        except PoolClosed as exc:
            raise APIError(503, str(exc), code="shutting_down", kind="server_error", retry_after=retry) from None

    async def start(self, prepared: Prepared, request: Request, names: dict):
        """Queue the job on the worker whose cache shares the most of its prompt, and wait for its first item
        (so bad requests still get a 400, not a broken stream)."""
        retry = self.options.retry_after
        job = self.submit(stream_work(prepared, self.codec), prompt_ids=prepared.prompt_ids, worker=prepared.worker,
                          request=prepared)
        try:
            first = await self.next_item(job, request, [time.monotonic()])
        except JobCancelled:
            raise APIError(503, "the server is shutting down: request cancelled", code="shutting_down",
                           kind="server_error", retry_after=retry) from None
        except ValueError as exc:  # the decoder's checks, made again by its stream (validated before: rare)
            raise option_error(exc, names) from None
        except BaseException:
            job.cancel()
            raise
        return job, first

    async def next_item(self, job, request: Request, checked: list):
        """The job's next item; a client gone meanwhile cancels the job (checked at most every poll period,
        whether items flow or not; ``checked`` holds the time of the last check)."""
        getter = asyncio.ensure_future(job.get())
        try:
            while True:
                wait = max(0.0, checked[0] + DISCONNECT_POLL_SECONDS - time.monotonic())
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if done and time.monotonic() < checked[0] + DISCONNECT_POLL_SECONDS:
                    return getter.result()
                checked[0] = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
                    self.metrics.disconnects += 1
                    raise ClientGone()
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def collect(self, job, first, request: Request) -> tuple[str, Done, list]:
        """(every text piece of the job joined, its ``Done``, the pieces' source spans joined)."""
        pieces, item, checked, done, logprobs, spans = [], first, [time.monotonic()], None, [], []
        while item is not END:
            if isinstance(item, Done):
                done = item
            elif isinstance(item, PrefillProgress):
                pass  # a streamed answer's: a whole answer carries none, as llama-server's
            else:
                pieces.append(piece_text(item))
                if isinstance(item, Piece):
                    logprobs.extend(item.logprobs or ())
                    spans.extend(item.spans or ())
            item = await self.next_item(job, request, checked)
        if done is not None and done.logprobs is not None:
            done.logprobs = logprobs + done.logprobs  # the whole answer's, for a one-shot response
        return "".join(pieces), self.finished(done, job), merge_spans(spans)

    def finished(self, done: Done, job) -> Done:
        done.queue_seconds = (job.started or job.submitted) - job.submitted
        self.metrics.add(done.stats)
        return done

    async def events(self, job, first, piece_lines, last_lines, error_lines, progress_lines=None):
        """Stream lines: ``progress_lines(progress)`` per ``PrefillProgress`` (a request ``Prepared`` with
        ``progress``), ``piece_lines(piece)`` per piece, then ``last_lines(done)``; a failure after the stream
        started becomes ``error_lines(message, code)`` (in-band, as every dialect reports it).

        The last lines wait for the job's END, which the pool sends once the worker is free: a client that sends
        its next turn on the stream's end is then routed to the worker holding its cache."""
        item, last = first, []
        try:
            while item is not END:
                if isinstance(item, Done):
                    last = list(last_lines(self.finished(item, job)))
                elif isinstance(item, PrefillProgress):
                    for line in progress_lines(item) if progress_lines is not None else ():
                        yield line
                else:
                    for line in piece_lines(item if isinstance(item, Piece) else Piece(item)):
                        yield line
                item = await job.get()
            for line in last:
                yield line
        except JobCancelled:
            for line in error_lines("the server is shutting down: generation cancelled", "shutting_down"):
                yield line
        except Exception as exc:  # the stream has started: report in-band
            log.exception("generation failed mid-stream")
            for line in error_lines(f"generation failed: {exc}", None):
                yield line
        finally:
            job.cancel()  # no-op when finished; frees the worker when the client went away mid-stream
