"""Key smoothing for an int8 KV cache: a factor per key channel, so that a scale per row quantizes every channel.

Qwen2-style keys carry a few channels tens of times larger than the rest (their k_proj biases), and a row's int8
scale is set by its largest value, so the small channels kept a few steps each: on the real 1.5B target, perplexity
+1.6% over a float32 cache (c=512). Attention reads keys only through q . k, so the graph stores each rotated key row
divided by a per-channel factor ``f`` and multiplies the queries by ``f``: ``(q * f) . (k / f) = q . k``. With ``f``
the largest magnitude of the channel's rotary pair over a calibration text (the rotary embedding turns channels i
and i + D/2 into each other with the position; the pair's magnitude stays), rounded up to a power of two (exact to
divide and multiply by), every channel of a stored row spans about [-1, 1] at any position and the row's scale
serves them all: the scale-per-row layout, and the attention's scale-per-column trick, stay. Emulated on the real
1.5B target's float16 cache (3 chunks of 512, 16-token passes): keys and values per row +0.48%, in blocks of 32
values (llama.cpp's ``q8_0``) +0.30%, keys smoothed by their channel peaks +0.14%.

The factors come from the source model's own float layers run over ``CALIBRATION_TEXT`` as the export streams them
(``stream_reference.StreamedReference``), and are written into the graph as initializers
``layers.{l}/attention/k{h}_smoothing`` ``[head_dim]`` (``read_key_smoothing``); the runtime never needs them (the
graph applies them), tools reading cache keys as values do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Code and prose, as the pair is used: the keys' channel ranges, not the text, are what calibration keeps
CALIBRATION_TEXT = '''import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Record:
    """One row of the report: a name, a count and the time it took."""

    name: str
    count: int
    seconds: float

    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")


def load(path: Path) -> list[Record]:
    with open(path, encoding="utf-8") as handle:
        rows = json.load(handle)
    return [Record(row["name"], int(row["count"]), float(row["seconds"])) for row in rows]


def summary(records: list[Record]) -> str:
    total = sum(record.count for record in records)
    fastest = max(records, key=Record.rate)
    return f"{len(records)} records, {total} items; fastest: {fastest.name} at {fastest.rate():.1f}/s"


if __name__ == "__main__":
    import sys

    print(summary(load(Path(sys.argv[1]))))

The report above reads a JSON file of timing records and prints one line about them. A record that took no time
at all has an infinite rate, which keeps the comparison total; an empty file is an error, because max() of
nothing has no answer. To speed it up for very large files, one would stream the rows instead of loading the
whole list, and keep only the running total and the best record so far.
'''
SMALLEST_SHARE = 1 / 64  # a factor is at least this share of its head's largest (a channel quiet in calibration)


def smoothing_name(layer: int, head: int) -> str:
    return f"layers.{layer}/attention/k{head}_smoothing"


def key_factors(keys: np.ndarray) -> np.ndarray:
    """keys: [S, kv_heads, D] float32 rotated keys of one layer over the calibration text -> [kv_heads, D] float32
    factors: the largest magnitude of each channel's rotary pair (at least ``SMALLEST_SHARE`` of its head's largest,
    and > 0) rounded up to a power of two, so that dividing and multiplying by a factor are exact in float32 (a row
    read back and stored again is the same row, and the scores q . k are the float cache's to the bit before
    rounding)."""
    keys = np.asarray(keys, dtype=np.float32)
    half = keys.shape[-1] // 2
    # the rotary embedding (non-interleaved, as the graph's) turns channel i and i + D/2 into each other with the
    # position, so both get the peak of the pair's magnitude, which no rotation changes: factors taken at the
    # calibration text's few hundred positions then hold at any position
    pairs = np.sqrt(keys[..., :half] ** 2 + keys[..., half:] ** 2).max(axis=0)  # [kv_heads, D/2]
    peaks = np.concatenate([pairs, pairs], axis=-1)  # [kv_heads, D]
    floor = np.maximum(peaks.max(axis=-1, keepdims=True) * np.float32(SMALLEST_SHARE), np.float32(2.0 ** -20))
    return np.exp2(np.ceil(np.log2(np.maximum(peaks, floor)))).astype(np.float32)


def read_key_smoothing(onnx_path: str | Path, layers: int, kv_heads: int) -> np.ndarray | None:
    """[layers, kv_heads, D] float32 factors stored in an int8-cache graph, or None (a graph without them)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    model = onnx.load(str(onnx_path), load_external_data=False)  # the graph only: the weights stay on disk
    found = {t.name: t for t in model.graph.initializer}
    if smoothing_name(0, 0) not in found:
        return None

    def factors(name: str) -> np.ndarray:
        tensor = found[name]
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(Path(onnx_path).parent))
        return numpy_helper.to_array(tensor)

    return np.stack([np.stack([factors(smoothing_name(layer, head)) for head in range(kv_heads)])
                     for layer in range(layers)]).astype(np.float32)
