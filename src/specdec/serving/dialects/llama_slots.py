"""llama-server's slots: ``GET /slots`` and ``POST /slots/{id}?action=save|restore|erase``. A slot is a pool worker
(its decoder's KV caches of both models).

``GET /slots`` (unless the server runs with ``--no-slots``: 501) answers one object per worker: llama-server's
``id``, ``n_ctx``, ``speculative``, ``is_processing``, and for a worker that has run a request its ``id_task``,
``n_prompt_tokens``, ``n_prompt_tokens_processed``, ``n_prompt_tokens_cache`` and ``next_token``; ``specdec`` says
how many tokens each model's cache holds. ``?fail_on_no_slot=1`` answers 503 when every worker is busy.

A slot action runs as a job pinned to that worker (serving/pool.py), so it never races a generation: on a busy
worker it waits for the running request to end, as llama-server defers it. ``save`` writes the worker's caches
to ``--slot-save-path``/filename (decoding/slot_file.py: keyed by the bundle's identity, checksummed, written
atomically; a file that is not a slot file of this bundle is never replaced: 409), ``restore`` loads one after
checking all of it (a file of another bundle, a truncated or changed one: 400, and the caches stay as they
were), ``erase`` empties the caches. Without ``--slot-save-path`` every action is 501, as in llama-server; a
filename with a path separator, "..", or that resolves outside the folder is 400 "Invalid filename".
"""

from __future__ import annotations

import time

from fastapi import Request

from specdec.decoding.slot_file import SlotFileConflict, SlotFileError, SlotUnsupported, SlotWriteError, slot_path
from specdec.serving.dialects.llama_models import SlotFileRequest
from specdec.serving.jobs import Engine, Prepared
from specdec.serving.pool import JobCancelled
from specdec.serving.wire import APIError

ACTIONS = ("save", "restore", "erase")


def slot_state(index: int, decoder, busy: bool, job) -> dict:
    """One worker as llama-server describes a slot, with what its caches hold."""
    slot = {"id": index, "n_ctx": decoder.max_context, "speculative": True, "is_processing": busy}
    if job is not None:
        slot["id_task"] = job.task_id
    if job is not None and isinstance(job.request, Prepared):
        stats, budget = job.request.stats, job.request.options.max_new_tokens
        slot.update(n_prompt_tokens=stats.prompt_tokens,
                    n_prompt_tokens_processed=max(0, stats.prompt_tokens - stats.cached_tokens),
                    n_prompt_tokens_cache=stats.cached_tokens,
                    next_token=[{"has_next_token": busy, "n_remain": max(0, budget - stats.new_tokens),
                                 "n_decoded": stats.new_tokens}])
    slot["specdec"] = {"target_tokens": decoder.target.length,
                       "draft_tokens": decoder.draft.length if decoder.draft is not None else 0}
    return slot


def action_work(action: str, index: int, path, filename: str | None):
    """The pinned job: the action on the worker's decoder, its answer in llama-server's shape."""

    def run(decoder):
        started = time.perf_counter()
        if action == "erase":
            yield {"id_slot": index, "n_erased": decoder.clear_cache()}
            return
        if action == "save":
            tokens, size = decoder.save_caches(path)
            yield {"id_slot": index, "filename": filename, "n_saved": tokens, "n_written": size,
                   "timings": {"save_ms": round((time.perf_counter() - started) * 1000.0, 3)}}
            return
        tokens, size = decoder.restore_caches(path)
        yield {"id_slot": index, "filename": filename, "n_restored": tokens, "n_read": size,
               "timings": {"restore_ms": round((time.perf_counter() - started) * 1000.0, 3)}}

    return run


class Slots:
    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    async def list(self, request: Request):
        if not self.server.slots_endpoint:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           kind="not_supported_error")
        pool = self.engine.pool
        states = pool.worker_states()
        slots = [slot_state(index, pool.decoders[index], busy, job) for index, (busy, job) in enumerate(states)]
        if request.query_params.get("fail_on_no_slot") and all(busy for busy, _ in states):
            raise APIError(503, "no slot available", code="no_slot_available", kind="server_error")
        return slots

    async def act(self, id_slot: str, request: Request, body: SlotFileRequest | None = None):
        folder = self.server.slot_save_path
        if folder is None:
            raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                           kind="not_supported_error")
        workers = self.engine.pool.options.workers
        try:
            index = int(id_slot)
        except ValueError:
            index = -1
        if not 0 <= index < workers:
            raise APIError(400, f"Invalid slot ID: id_slot must be a slot id in 0..{workers - 1}", param="id_slot")
        action = request.query_params.get("action")
        if action not in ACTIONS:
            raise APIError(400, f"Invalid action: action must be one of {', '.join(ACTIONS)}", param="action")
        path = filename = None
        if action != "erase":
            filename = body.filename if body is not None else None
            if filename is None:
                raise APIError(400, "filename: required (a file name inside the slot save folder)", param="filename")
            try:
                path = slot_path(folder, filename)
            except SlotFileError as exc:
                raise APIError(400, str(exc), param="filename") from None
        return await self.run(action_work(action, index, path, filename), index, request)

    async def run(self, work, index: int, request: Request) -> dict:
        job = self.engine.submit(work, worker=index)
        try:
            answer = await self.engine.next_item(job, request, [time.monotonic()])
            await job.get()  # END: the worker is free again
        except JobCancelled:
            raise APIError(503, "the server is shutting down: slot action cancelled", code="shutting_down",
                           kind="server_error", retry_after=self.server.retry_after) from None
        except SlotFileConflict as exc:
            raise APIError(409, str(exc), param="filename") from None
        except SlotWriteError as exc:
            raise APIError(500, str(exc), kind="server_error") from None
        except SlotUnsupported as exc:
            raise APIError(501, str(exc), kind="not_supported_error") from None
        except SlotFileError as exc:
            raise APIError(400, str(exc), param="filename") from None
        return answer


def mount(app, engine: Engine, server) -> None:
    slots = Slots(engine, server)
    app.add_api_route("/slots", slots.list, methods=["GET"])
    app.add_api_route("/slots/{id_slot}", slots.act, methods=["POST"])
