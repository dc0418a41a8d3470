"""The weight bytes a one-token pass reads, beside the decode rate that read them: specdec's target as onnxruntime's
CPU kernels pack it (``contract.onnx_paths.one_token_bytes``) and llama.cpp's GGUF. Bytes per token times tokens per
second is the memory rate a runtime reached; where a one-token pass is bandwidth-bound, the bytes decide its speed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specdec.contract.bundle import inside
from specdec.contract.onnx_paths import one_token_bytes


def target_bytes(bundle_dir, manifest, form: str | None) -> dict:
    """``{"form", "file", "streamed", "gathered"}`` of the target's weight form ``form`` (None: its one form)."""
    spec = manifest.target
    onnx_file = dict(spec.weight_forms).get(form, spec.onnx_file)
    counts = one_token_bytes(inside(Path(bundle_dir), onnx_file).read_bytes())
    return {"form": form, "file": onnx_file, **counts}


def gguf_bytes(path) -> int | None:
    """Bytes of a GGUF's tensors a token reads (every tensor but the token embedding, which llama.cpp gathers rows
    of, unless the file has no ``output.weight`` and llama.cpp multiplies by the embedding instead); None without
    the ``gguf`` package (the [export] extra)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or not t.name.startswith("token_embd"))


def read_bandwidth(processes: int, gib: float = 0.5) -> float:
    """GB/s that ``processes`` processes, each summing its own ``gib`` GiB array (numpy, best of 5), reach together:
    the machine's read bandwidth, beside which a one-token pass's GB/s says how bandwidth-bound it is."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        seconds = pool.map(_read_seconds, [gib] * processes)
    return processes * gib * 2**30 / max(seconds) / 1e9


def _read_seconds(gib: float) -> float:
    data = np.ones(int(gib * 2**30 / 8), dtype=np.float64)
    data.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return best


def memory_rate_line(weights: dict, summary: list) -> str | None:
    """One line of a bench report: bytes per token and the GB/s they were read at by target-only decoding and by
    llama.cpp plain, beside the machine's read bandwidth (``weights``: ``{"target": target_bytes(...), "gguf":
    {"file", "bytes"} or None, "read_bandwidth": {"gbs", "processes"} or None}``)."""
    target = weights.get("target")
    if not target:
        return None
    rate = {row["mode"]: row["tokens_per_s"] for row in summary if row["kind"] == "all"}

    def read(size: int, mode: str) -> str:
        tok_s = rate.get(mode)
        return "" if not tok_s else f", at {tok_s:.2f} tok/s {size * tok_s / 1e9:.1f} GB/s"

    form = f"the target's {target['form']} form" if target.get("form") else "the target"
    line = (f"Weights a one-token pass reads (as packed for onnxruntime's CPU kernels; tables read a row at a time "
            f"not counted): {form} {target['streamed'] / 2**20:,.1f} MiB{read(target['streamed'], '0')} "
            "(target only)")
    gguf = weights.get("gguf")
    if gguf and gguf.get("bytes"):
        line += (f"; the GGUF {gguf['file']} {gguf['bytes'] / 2**20:,.1f} MiB"
                 f"{read(gguf['bytes'], 'llama:target')} (llama.cpp plain)")
    bandwidth = weights.get("read_bandwidth")
    if bandwidth:
        line += (f"; this machine reads {bandwidth['gbs']:.1f} GB/s ({bandwidth['processes']} processes summing "
                 "their own arrays, before the models loaded)")
    return line + "."
