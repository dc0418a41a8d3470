"""A shuffled A/B of decoder settings on one loaded decoder: arms as data, each run cold, the arms' order
shuffled afresh for every prompt so a burst of load on a shared machine lands on every arm alike.

An arm is a name, ``generate`` options and settings applied before each of its runs: attributes reached from
the decoder (``"probe_budget.share"``) or module constants (``"specdec.decoding.proposers.draft:DRAFT_MAX_PROBE_EVERY"``).
Before every run each setting any arm names is put back to its value at the start, then the arm's own are
applied; all are restored at the end. The summary compares each arm with a baseline arm per prompt kind:
summed decode tokens/s (ratio of sums), the median of the per-pair ratios, the pairs where the arm is faster,
the draft model's seconds, and how many outputs are token-identical to the baseline's.
"""

from __future__ import annotations

import importlib
import random
import statistics
from dataclasses import dataclass, field

from specdec.bench.bench import start_cold
from specdec.sampling.processors import SamplingConfig


@dataclass(frozen=True)
class Arm:
    name: str
    options: dict = field(default_factory=dict)  # generate() keyword arguments
    settings: dict = field(default_factory=dict)  # "module:NAME" or "attr.path" on the decoder -> value


def parse_arms(spec) -> list:
    """``{"name": {"options": {...}, "settings": {...}}, ...}`` (a JSON object) as arms; one ValueError line
    naming what is wrong."""
    if not isinstance(spec, dict) or len(spec) < 2:
        raise ValueError("arms: a JSON object of at least two arms, name -> {\"options\": ..., \"settings\": ...}")
    arms = []
    for name, body in spec.items():
        if not isinstance(body, dict) or set(body) - {"options", "settings"}:
            raise ValueError(f"arms: {name!r} must be an object with only \"options\" and \"settings\"")
        options, settings = body.get("options", {}), body.get("settings", {})
        if not isinstance(options, dict) or not isinstance(settings, dict):
            raise ValueError(f"arms: {name!r}: \"options\" and \"settings\" must be objects")
        arms.append(Arm(name, dict(options), dict(settings)))
    return arms


def _target(decoder, key: str) -> tuple:
    """(object, attribute name) that ``key`` names; ValueError if it does not exist."""
    if ":" in key:
        module, name = key.split(":", 1)
        try:
            holder = importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"arms: setting {key!r}: no module {module!r}") from error
    else:
        *path, name = key.split(".")
        holder = decoder
        for part in path:
            holder = getattr(holder, part, None)
    if holder is None or not hasattr(holder, name):
        raise ValueError(f"arms: setting {key!r} names nothing that exists")
    return holder, name


def run_arms(decoder, prompts: list, arms: list, repeats: int = 1, max_new_tokens: int = 128, seed: int = 11,
             progress=None) -> list:
    """Every prompt ``repeats`` times under every arm (greedy), the arms shuffled per prompt; one row per run."""
    keys = sorted({key for arm in arms for key in arm.settings})
    targets = {key: _target(decoder, key) for key in keys}
    originals = {key: getattr(*targets[key]) for key in keys}
    greedy = SamplingConfig(temperature=0.0)
    rng = random.Random(seed)
    rows = []
    try:
        for repeat in range(repeats):
            for prompt in prompts:
                order = list(arms)
                rng.shuffle(order)
                for arm in order:
                    for key in keys:
                        setattr(*targets[key], arm.settings.get(key, originals[key]))
                    start_cold(decoder)
                    result = decoder.generate(prompt["prompt"], max_new_tokens=max_new_tokens, sampling=greedy,
                                              **arm.options)
                    stats = result.stats
                    rows.append({"repeat": repeat, "id": prompt["id"], "kind": prompt.get("kind", "all"),
                                 "arm": arm.name, "tokens": stats.new_tokens, "seconds": stats.decode_seconds,
                                 "prefill_seconds": stats.prefill_seconds,
                                 "draft_seconds": stats.draft_seconds, "draft_forwards": stats.draft_forwards,
                                 "target_forwards": stats.target_forwards, "ids": list(result.token_ids)})
                    if progress is not None:
                        progress(f"{repeat} {prompt['id']} {arm.name}: {stats.tokens_per_s:.2f} tok/s, draft "
                                 f"{stats.draft_forwards} passes {stats.draft_seconds:.2f} s")
    finally:
        for key in keys:
            setattr(*targets[key], originals[key])
    return rows


def summarize_arms(rows: list, baseline: str) -> dict:
    """kind ("all" and each prompt kind) -> arm -> figures against ``baseline``."""
    runs = {(row["repeat"], row["id"], row["arm"]): row for row in rows}
    kinds = ["all"] + sorted({row["kind"] for row in rows})
    arms = list(dict.fromkeys(row["arm"] for row in rows))
    summary = {}
    for kind in kinds:
        pairs = sorted({(row["repeat"], row["id"]) for row in rows if kind in ("all", row["kind"])})
        base = [runs[pair + (baseline,)] for pair in pairs]
        base_rate = sum(r["tokens"] for r in base) / sum(r["seconds"] for r in base)
        timed_prefill = all("prefill_seconds" in row for row in rows)  # rows of older runs lack it
        summary[kind] = {}
        for arm in arms:
            mine = [runs[pair + (arm,)] for pair in pairs]
            ratios = [(m["tokens"] / m["seconds"]) / (b["tokens"] / b["seconds"]) for m, b in zip(mine, base)]
            summary[kind][arm] = {
                "pairs": len(pairs),
                "summed_ratio": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine) / base_rate,
                # prefill included (both models'): a lazily prefilled draft pays inside decoding, an eager one before
                "end_to_end_ratio": _end_to_end(base) / _end_to_end(mine) if timed_prefill else None,
                "median_ratio": statistics.median(ratios),
                "faster_pairs": sum(ratio > 1.0 for ratio in ratios),
                "draft_seconds": sum(r["draft_seconds"] for r in mine),
                "draft_forwards": sum(r["draft_forwards"] for r in mine),
                "same_output": sum(m["ids"] == b["ids"] for m, b in zip(mine, base)),
            }
    return summary


def _end_to_end(rows: list) -> float:
    """Seconds per token, prefill included, over ``rows``."""
    return sum(r["seconds"] + r["prefill_seconds"] for r in rows) / sum(r["tokens"] for r in rows)


def arms_markdown(summary: dict, baseline: str) -> str:
    lines = [f"| kind | arm | pairs | summed vs {baseline} | per-pair median | end-to-end vs {baseline} | faster pairs "
             f"| draft s | draft passes | same output |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, arms in summary.items():
        for arm, f in arms.items():
            end_to_end = "-" if f.get("end_to_end_ratio") is None else f"{f['end_to_end_ratio']:.3f}"
            lines.append(f"| {kind} | {arm} | {f['pairs']} | {f['summed_ratio']:.3f} | {f['median_ratio']:.3f} | "
                         f"{end_to_end} | "
                         f"{f['faster_pairs']} | {f['draft_seconds']:.1f} | {f['draft_forwards']} | "
                         f"{f['same_output']} |")
    return "\n".join(lines) + "\n"
