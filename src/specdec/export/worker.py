"""Run one export step in a fresh worker process; its failures come back as one line.

Each model is loaded, exported and checked in its own process, so everything PyTorch, the GGUF
loader and the exporter allocated is returned to the system when it ends. A failure in the worker
is an ExportError of one line (the traceback kept in ``.detail``); a worker that dies (out of
memory) is reported, never waited on forever; an interrupted parent stops its worker; a killed
parent takes its worker with it (Linux PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback

from specdec.export.sources import SourceError


class ExportError(ValueError):
    """An export failed; the message is one line. ``detail``: the full traceback, when there was one."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail

    def __reduce__(self):  # crosses the worker -> parent pipe with its detail
        return (type(self), (str(self), self.detail))


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``exc`` as one line: its message, whitespace collapsed, led by its type unless it is one of specdec's."""
    text = " ".join(str(exc).split()) or "(no message)"
    if not type(exc).__module__.startswith("specdec"):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _worker_setup() -> None:
    """In a worker: exit when the exporting parent dies (Linux prctl); leave Ctrl-C to the parent,
    which stops the worker itself (a worker's own KeyboardInterrupt would print a traceback)."""
    import ctypes
    import signal

    _quiet_third_party()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)  # the parent stops it: unwind, so its resources are released
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _quiet_third_party() -> None:
    """Keep torch's, transformers' and tqdm's warnings and progress bars out of an export's output (the
    exporter reports its own progress and errors); ``SPECDEC_DEBUG=1`` keeps them."""
    import logging
    import os
    import warnings

    if os.environ.get("SPECDEC_DEBUG"):
        return
    warnings.filterwarnings("ignore")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    for name in ("onnxscript", "transformers", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # torch configures its own loggers' levels when imported: a filter on the logger that warns survives that
    logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(
        lambda record: record.levelno >= logging.ERROR)  # "torchvision is not installed. Skipping ..."
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


class _WorkerStopped(BaseException):
    pass


def _stop_worker(signum, frame):
    raise _WorkerStopped()


def _worker_main(connection, function, args) -> None:
    """Body of a worker process: run ``function(*args)``, send back ("ok", result) or ("error", ExportError)."""
    _worker_setup()
    try:
        result = ("ok", function(*args))
    except _WorkerStopped:
        return  # the parent stopped waiting: nobody to answer
    except BaseException as exc:  # every failure goes back as one line (+ the traceback for SPECDEC_DEBUG)
        role = next((a for a in args if a in ("target", "draft")), "export")
        message = one_line(exc)
        if not isinstance(exc, (SourceError, ExportError)):
            message = f"{role}: export failed: {message}"
        result = ("error", ExportError(message, traceback.format_exc()))
    gc.collect()  # after a failure: finalize what the failed frames held before exiting
    try:
        connection.send(result)
        connection.close()
    except (OSError, _WorkerStopped):
        pass  # the parent is gone or stopped waiting
    finally:
        # the answer is sent: a stop from now on (e.g. while atexit handlers run) just ends the process,
        # instead of raising inside whatever handler is running and printing its traceback
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _quiet_environment():
    """TQDM_DISABLE in the environment the worker starts with: tqdm reads it when first imported, which in the
    worker happens while the arguments are unpickled (gguf imports it), before ``_worker_setup``; transformers'
    GGUF loader's bar has no switch of its own. The parent's environment is restored once the worker started."""
    if os.environ.get("SPECDEC_DEBUG") or "TQDM_DISABLE" in os.environ:
        yield
        return
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TQDM_DISABLE", None)


def run_isolated(function, *args):
    """Run ``function(*args)`` in a fresh process and return its result (see the module docstring).

    Why a process per model: the next model (and the quantizer) start from a small parent instead of
    on top of ~8 GB of freed-but-held memory (measured on the 1.5B target).
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker_main, args=(send, function, args), name="specdec-export-worker")
    with _quiet_environment():
        worker.start()
    send.close()
    try:
        try:
            status, payload = receive.recv()
        except EOFError:
            worker.join()
            raise ExportError(f"the export worker process died (exit code {worker.exitcode}) before finishing: "
                              "out of memory, or killed") from None
    finally:
        receive.close()
        if worker.is_alive():  # interrupted: stop the worker (SIGTERM lets it release what it holds), then make sure
            worker.terminate()
            worker.join(5)
            if worker.is_alive():
                worker.kill()
        worker.join()
    if status == "error":
        raise payload
    return payload
