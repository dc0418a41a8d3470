"""Export a draft and a target into one bundle folder, atomically.

Layout of a bundle::

    manifest.json          the I/O contract and sha256 of every file (specdec.runtime.manifest)
    tokenizer/             tokenizer.json (+ tokenizer_config.json with the chat template)
    target/model.onnx      + model.onnx.data (external weights)
    draft/model.onnx       + model.onnx.data

Everything is written into a hidden staging folder beside the destination
(``.OUT.partial-PID``) and swapped into place only when complete, so an interrupted or failed
export never leaves a half bundle under the destination name and never touches an existing
bundle until the new one is whole. ``--out`` is replaced only when it is a specdec bundle
holding nothing but bundle files; any other folder is refused and left untouched. Staging
folders of export processes that no longer run are removed by the next export to the same
place. Everything that can be checked without a model (sources, weights files' headers,
tokenizers, draft/target compatibility, the parity text) is checked before any export starts.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from specdec.runtime.bundle import sha256_file
from specdec.runtime.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest

from .compat import check_pair_facts, check_specs, check_tokenizers, pair_facts, special_token_ids
from .leftovers import dead_leftovers
from .quantize import BLOCK_SIZE, BLOCK_SIZES, DRAFT_BLOCK_SIZE, QUANTS, quantize_onnx
from .sources import DTYPES, ModelSource, SourceError, load_configs, load_model, load_tokenizer, resolve_source

PARITY_PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n"
PARITY_EXTRA = " if n < 2: return n"


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


@dataclass(frozen=True)
class ExportOptions:
    target: str
    draft: str | None
    out: Path
    dtype: str = "float32"
    quant: str = "none"
    parity: bool = True
    # MatMulNBits accuracy_level: 4 = int8 activations (the fast CPU kernels; a verify pass over
    # 5 tokens then costs ~1.5x one token instead of ~2.6x with 0 = float32 compute)
    accuracy_level: int | None = 4
    block_size: int = BLOCK_SIZE  # weights per quantization scale, target
    draft_block_size: int = DRAFT_BLOCK_SIZE  # and draft (coarser: a faster draft at the same acceptance)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quant not in QUANTS:
            raise ValueError(f"--quant {self.quant!r} is not one of {', '.join(QUANTS)}")
        if self.quant in ("int4", "int8") and self.dtype != "float32":
            raise ValueError(f"--quant {self.quant} (MatMulNBits) applies to a float32 export: use --dtype float32")
        if self.quant == "int4-qdq" and self.dtype not in ("float32", "float16"):
            raise ValueError("--quant int4-qdq applies to a float32 or float16 export")
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError("--accuracy-level must be 0..4 (onnxruntime MatMulNBits)")
        for flag, size in (("--block-size", self.block_size), ("--draft-block-size", self.draft_block_size)):
            if size not in BLOCK_SIZES:
                raise ValueError(f"{flag} {size} is not one of {', '.join(map(str, BLOCK_SIZES))}")

    def block_size_for(self, role: str) -> int:
        return self.draft_block_size if role == "draft" else self.block_size


def rss_gib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB, from /proc (0 where unknown)."""
    values = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    values[line.split(":")[0]] = int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)


class Progress:
    """Timestamped progress lines on stderr, with this process's memory (current / peak GiB)."""

    def __init__(self, stream=None):
        self.start = time.monotonic()
        self.stream = stream

    def __call__(self, message: str) -> None:
        rss, peak = rss_gib()
        print(f"[{time.monotonic() - self.start:7.1f}s {rss:5.1f}/{peak:4.1f} GiB] {message}",
              file=self.stream or sys.stderr, flush=True)


def hash_tree(root: Path) -> dict:
    return {
        str(path.relative_to(root).as_posix()): sha256_file(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }


def tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("specdec", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "gguf"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


_LEFTOVER = re.compile(r"^\.[^/]+\.partial-\d+$")  # a file a killed specdec process was writing


def _bundle_files(out: Path) -> set | None:
    """Relative paths a specdec manifest at ``out`` lists (plus manifest.json), or None if it has none.

    Deliberately lenient about the manifest's version and fields (an older bundle may be replaced),
    strict about what it lists: that list is what decides which files are the bundle's.
    """
    import json

    try:
        data = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("format_version"), int)
            and isinstance(data.get("target"), dict) and isinstance(data.get("files"), dict)):
        return None
    return {MANIFEST_NAME} | {str(key) for key in data["files"]}


def check_destination(out: Path) -> None:
    """Refuse (SourceError, one line) an ``--out`` that is not absent, an empty folder or a specdec bundle.

    A bundle may be replaced only if every file under it is one its manifest lists (or a leftover
    ``.NAME.partial-PID`` file of a killed specdec process): nothing a user put there is ever deleted.
    """
    if out.is_symlink():
        raise SourceError(f"--out {out} is a symbolic link: give the real folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise SourceError(f"--out {out} exists and is not a folder: refusing to replace it")
    entries = list(out.rglob("*"))
    if not entries:
        return
    listed = _bundle_files(out)
    if listed is None:
        raise SourceError(f"--out {out} is a non-empty folder that is not a specdec bundle (no valid {MANIFEST_NAME}): "
                          "refusing to replace it; choose another --out")
    folders = {parent.as_posix() for rel in listed for parent in Path(rel).parents if parent != Path(".")}
    for path in sorted(entries):
        relative = path.relative_to(out).as_posix()
        if path.is_dir() and not path.is_symlink():
            ok = relative in folders
        else:
            ok = (relative in listed and not path.is_symlink()) or bool(_LEFTOVER.match(path.name))
        if not ok:
            raise SourceError(f"--out {out} holds {relative}, which is not part of the specdec bundle there: "
                              "refusing to replace it; choose another --out or move that file")


def remove_dead_staging(out: Path, progress=None) -> None:
    """Clean up after export processes to ``out`` that were killed (never touches a live one's folders).

    ``.OUT.partial-PID``: an unfinished export, or an old bundle swapped out but not yet removed: deleted.
    ``.OUT.old-PID``: a bundle moved aside by the two-rename fallback swap: put back if ``out`` is missing
    (the process died between the renames), else deleted.
    """
    progress = progress or _silent
    for path in dead_leftovers(out, "partial"):
        progress(f"removing {path.name}, left by an export process that no longer runs")
        shutil.rmtree(path, ignore_errors=True)
    for path in dead_leftovers(out, "old"):
        if not out.exists():
            progress(f"restoring {out} from {path.name} (an export process died while replacing it)")
            os.rename(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _write_failure(exc: OSError, where: Path) -> str:
    """One line for a failed write, naming the path and the free space (numpy's errors name neither)."""
    try:
        free = f"{shutil.disk_usage(where if where.exists() else where.parent).free / 1e6:.0f} MB free there"
    except OSError:
        free = "free space unknown"
    path = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    reason = exc.strerror or " ".join(str(exc).split())
    full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"writing the export under {where.absolute()} failed{full}: {reason}{path}; {free}"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _export_float(role, source: ModelSource, tokenizer, options: ExportOptions, staging: Path, progress) -> tuple:
    """Load, export and check the float graph (run in a worker process). Returns what quantization needs."""
    from .onnx_export import ONNX_NAME, export_model
    from .parity import check_parity, reference_outputs

    progress(f"{role}: loading {source.label} ({options.dtype})")
    try:
        model = load_model(source, options.dtype)
    except (SourceError, MemoryError):
        raise
    except Exception as exc:  # a truncated / corrupt weights file: safetensors, gguf and torch each raise their own
        raise SourceError(f"cannot load the {role} model from {source.label}: {one_line(exc)}") from None
    special = special_token_ids(model, tokenizer)
    prompt, extra = _encode(tokenizer, PARITY_PROMPT), _encode(tokenizer, PARITY_EXTRA)
    extra = (extra * 5)[:5]
    references = None
    if options.parity:
        progress(f"{role}: PyTorch reference outputs for the parity check")
        references = reference_outputs(model, prompt, extra)
    float_dir = staging / (role if options.quant == "none" else f".{role}-float")
    progress(f"{role}: exporting ONNX ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")
    try:
        spec = export_model(model, role, float_dir, special, options.dtype)  # consumes the model
    except OSError as exc:
        raise ExportError(f"{role}: {_write_failure(exc, float_dir)}") from None
    del model
    gc.collect()
    parity = {}
    if references is not None and options.dtype == "float32":
        progress(f"{role}: parity check of the float graph (prefill, decode, chain verify, tree)")
        parity["float"] = check_parity(references, float_dir / ONNX_NAME, spec, prompt, extra)
    elif references is not None:
        parity["float"] = "skipped: onnxruntime's CPU kernels do not cover every float16/bfloat16 op this graph uses"
    return spec, parity, references, prompt, extra, float_dir


def _export_one(role, source: ModelSource, tokenizer, options: ExportOptions, staging: Path, progress) -> tuple:
    """Export one model: the float graph in a worker process, then (after it has exited) quantization."""
    from .onnx_export import ONNX_NAME
    from .parity import check_parity

    spec, parity, references, prompt, extra, float_dir = _isolated(
        _export_float, role, source, tokenizer, options, staging, _for_worker(progress)
    )
    if options.quant != "none":
        block = options.block_size_for(role)
        progress(f"{role}: quantizing weights to {options.quant} (block {block})")
        quantize_onnx(float_dir / ONNX_NAME, staging / role / ONNX_NAME, options.quant, options.accuracy_level,
                      block_size=block)
        shutil.rmtree(float_dir)
        spec = replace(spec, quant=options.quant)
        if references is not None:
            progress(f"{role}: parity check of the {options.quant} graph (error includes quantization)")
            parity[options.quant] = check_parity(references, staging / role / ONNX_NAME, spec, prompt, extra)
    return spec, parity


def _worker_setup() -> None:
    """In a worker: exit when the exporting parent dies (Linux prctl); leave Ctrl-C to the parent,
    which stops the worker itself (a worker's own KeyboardInterrupt would print a traceback)."""
    import ctypes
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)  # the parent stops it: unwind, so its resources are released
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _WorkerStopped(BaseException):
    pass


def _stop_worker(signum, frame):
    raise _WorkerStopped()


def _silent(message: str) -> None:
    pass


def _for_worker(progress):
    """The progress reporter a worker process can use (callers' closures cannot cross processes)."""
    return progress if isinstance(progress, Progress) else _silent


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


def _isolated(function, *args):
    """Run ``function(*args)`` in a fresh process and return its result.

    Each model is loaded, exported and checked in its own process, so everything PyTorch,
    the GGUF loader and the exporter allocated is returned to the system when it ends: the
    next model (and the quantizer) start from a small parent instead of on top of ~8 GB of
    freed-but-held memory (measured on the 1.5B target). A worker's failure comes back as an
    ExportError of one line; a worker that dies (out of memory) is reported, never waited on
    forever; an interrupted parent kills its worker.
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker_main, args=(send, function, args), name="specdec-export-worker")
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


def _check_parity_text(role: str, tokenizer) -> None:
    for text in (PARITY_PROMPT, PARITY_EXTRA):
        if not _encode(tokenizer, text):
            raise ExportError(f"the {role} tokenizer encodes the parity text {text!r} to no token ids: "
                              "the export cannot be checked; fix the tokenizer or pass --no-parity")


def export_bundle(options: ExportOptions, progress=None) -> Manifest:
    """Export ``options.target`` (and ``options.draft``) into ``options.out``; returns the manifest written.

    Raises a ValueError subclass (SourceError, IncompatiblePair, ExportError) with one line on any
    failure; ``options.out`` is then exactly as it was.
    """
    progress = progress or Progress()
    started = time.monotonic()
    out = Path(options.out)
    check_destination(out)
    target_source = resolve_source(options.target)
    draft_source = resolve_source(options.draft) if options.draft else None
    progress("loading tokenizers")
    tokenizers = {"target": load_tokenizer(target_source)}
    if draft_source is not None:
        tokenizers["draft"] = load_tokenizer(draft_source)
        check_tokenizers(tokenizers["target"], tokenizers["draft"])
        # vocabulary and special tokens from the configs: a mismatch costs seconds here, not two exports
        check_pair_facts(pair_facts(*load_configs(target_source), tokenizers["target"]),
                         pair_facts(*load_configs(draft_source), tokenizers["draft"]))
    if options.parity:
        for role, tokenizer in tokenizers.items():
            _check_parity_text(role, tokenizer)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create the folder for --out {out}: {one_line(exc)}") from None
    remove_dead_staging(out, progress)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        specs, parity = {}, {}
        if draft_source is not None:
            specs["draft"], parity["draft"] = _export_one("draft", draft_source, tokenizers["draft"], options,
                                                          staging, progress)
        specs["target"], parity["target"] = _export_one("target", target_source, tokenizers["target"], options,
                                                        staging, progress)
        if draft_source is not None:
            check_specs(specs["target"], specs["draft"])
        tokenizers["target"].save_pretrained(str(staging / "tokenizer"))
        progress("hashing files")
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            target=specs["target"],
            draft=specs.get("draft"),
            tokenizer_file="tokenizer/tokenizer.json",
            files=hash_tree(staging),
            tools=tool_versions(),
            extra={"parity_max_abs_error": parity, "export_seconds": round(time.monotonic() - started, 1),
                   **({"quant_block_size": {role: options.block_size_for(role) for role in specs}}
                      if options.quant != "none" else {})},
        )
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        _swap_into_place(staging, out)
    except OSError as exc:
        raise ExportError(_write_failure(exc, staging)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _swap_into_place(staging: Path, out: Path) -> None:
    """Put the finished staging folder at ``out``; an existing bundle is swapped out, then removed.

    The destination is checked again first (someone may have put files there during the export).
    With an atomic exchange ``out`` is never missing; the fallback (two renames) leaves the old
    bundle at ``.OUT.old-PID`` for a moment, which the next export restores if this one dies there.
    """
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    check_destination(out)
    if not out.exists():
        os.rename(staging, out)
        return
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # now the old bundle
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)
