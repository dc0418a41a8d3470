"""``specdec bench``: speculative vs target-only, side by side in one process, on the same prompts.

Modes (draft lengths, "auto", 0 = target-only) run interleaved per prompt, in a rotating
order, for ``--repeat`` passes, so machine noise hits every mode alike. Reported per mode and
prompt kind: decode tokens/s; speedup vs target-only (ratio of summed times for the same
prompts), decode-only and end-to-end (prefill included: only speculative modes prefill a
draft); the per-token acceptance (the geometric model's estimate, the one the cost model
takes) beside accepted/proposed; mean accepted per round; time split; resident memory; the
cost model's predicted speedup (costs calibrated at context 256 and, for a long-prompt set,
at its median context too); and (greedy) how many outputs are token-identical to target-only.
Every run starts cold: empty KV caches and an empty suffix store (no run matches another's output;
the session benchmark's traces are where earlier outputs count).
Values a peer library cannot report are None ("-" in the table).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specdec.bench.weights_read import memory_rate_line
from specdec.decoding.cost_model import CALIBRATION_CONTEXT, Costs, calibrate, expected_speedup, per_token_acceptance

WARM_UP_TOKENS = 8  # the untimed first request of specdec and of each peer (first runs allocate)
LONG_CONTEXT = 512  # a prompt set whose median decode context reaches this is also calibrated there


def _decoder_limits() -> dict:
    """The decoder's own limits, so bench refuses exactly what generate() would refuse."""
    from specdec.contract import limits
    from specdec.decoding.proposers import proposer_names

    return {"max_draft": limits.MAX_DRAFT_TOKENS, "max_tree_nodes": limits.MAX_TREE_NODES,
            "proposers": proposer_names()}


def build_modes(draft_tokens: str, proposers: str = "", trees: str = "") -> dict:
    """label -> generate() keyword arguments; "0" (target-only) is always first.

    Every item is checked here, before anything runs: draft lengths in 0..MAX_DRAFT_TOKENS or "auto",
    known proposers, tree shapes that parse and fit in one verify pass. Errors are one ValueError line
    naming the option.
    """
    from specdec.decoding.options import GenerationOptions
    from specdec.decoding.tree import AUTO_TREE_BUDGET, parse_tree, tree_size

    limits = _decoder_limits()
    modes = {"0": {"num_draft_tokens": 0}}
    for item in filter(None, (part.strip() for part in draft_tokens.split(","))):
        if item == "auto":  # the product default: auto lengths, hybrid proposals
            modes["auto"] = {"num_draft_tokens": "auto"}
            continue
        try:  # the range is GenerationOptions' (one check, the one generate() makes)
            length = GenerationOptions(num_draft_tokens=int(item)).num_draft_tokens
        except ValueError:
            raise ValueError(f"--draft-tokens: {item!r} is not a draft length (an integer in 0..{limits['max_draft']}"
                             " or auto)") from None
        if length > 0:  # a fixed chain from the draft model
            modes[str(length)] = {"num_draft_tokens": length, "proposer": "draft"}
    for proposer in filter(None, (part.strip() for part in proposers.split(","))):
        if proposer not in limits["proposers"]:
            raise ValueError(f"--proposers takes {', '.join(limits['proposers'])}, got {proposer!r}")
        modes[f"auto:{proposer}"] = {"num_draft_tokens": "auto", "proposer": proposer}
    for shape in filter(None, (part.strip() for part in trees.split(";"))):
        try:
            parsed = parse_tree(shape)
        except ValueError as exc:
            raise ValueError(f"--trees: {exc}") from None
        nodes = AUTO_TREE_BUDGET if parsed == "auto" else tree_size(parsed)
        if nodes > limits["max_tree_nodes"]:
            raise ValueError(f"--trees: {shape!r} has {nodes} nodes, more than the {limits['max_tree_nodes']} "
                             "one verify pass may hold")
        modes[f"tree:{shape}"] = {"tree": shape}
    return modes


def load_prompts(path: str, limit: int | None) -> list:
    """The prompt set: a non-empty JSON list of {"prompt": non-empty str, "id": str (unique), "kind": str}."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit must be an integer >= 1, got {limit!r}")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read prompts from {path}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path} must be a non-empty JSON list of objects with a 'prompt' (and optional 'id', 'kind')")
    prompts, seen = [], {}
    for index, item in enumerate(data):
        where = f"{path}: item {index}"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object with a 'prompt', got {type(item).__name__}")
        prompt = item.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {json.dumps(prompt)[:40]}")
        for key in ("id", "kind"):
            if key in item and (not isinstance(item[key], str) or not item[key]):
                raise ValueError(f"{where}: '{key}' must be a non-empty string, got {json.dumps(item[key])[:40]}")
        prompt_id = item.get("id", str(index))
        if prompt_id in seen:
            raise ValueError(f"{where}: id {prompt_id!r} is also the id of item {seen[prompt_id]}: ids must be unique "
                             "(runs are matched to target-only by id)")
        seen[prompt_id] = index
        prompts.append({"id": prompt_id, "kind": item.get("kind", "all"), "prompt": prompt})
    return prompts[:limit] if limit else prompts


def check_bench_args(args) -> None:
    """The numeric options and the output folder, before anything is loaded or run."""
    import math

    for flag, value in (("--repeat", args.repeat), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    peers = (args.peer_transformers, args.peer_genai, getattr(args, "peer_llama_server", None),
             getattr(args, "peer_openvino", False))
    if any(peers) and args.temperature != 0:
        raise ValueError("peer columns are greedy only: use --temperature 0")


def check_writable(out: Path) -> None:
    """Create ``out`` and write a file into it now, so results are never lost to an unwritable folder at the end."""
    probe = out / f".bench-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {out} is not a writable folder: {exc.strerror or exc}") from None


def preflight(decoder, prompts: list, modes: dict, max_new_tokens: int, temperature: float) -> None:
    """Every (prompt, mode) request through the decoder's own argument checks, before the first run.

    Catches what needs the bundle: a mode needing a draft model the bundle lacks, a prompt too long for
    max_context with this mode's draft tokens. Nothing is generated.
    """
    from specdec.sampling.processors import SamplingConfig

    sampling = SamplingConfig(temperature=temperature)
    for item in prompts:
        for label, mode in modes.items():
            request = {"num_draft_tokens": "auto", "proposer": None, "tree": None, **mode}
            try:
                decoder.validate(item["prompt"], max_new_tokens=max_new_tokens, sampling=sampling, seed=0, stop=(),
                                 **request)
            except ValueError as exc:
                raise ValueError(f"prompt {item['id']!r}, mode {label}: {exc}") from None


def run_bench(decoder, prompts: list, modes: dict, max_new_tokens: int, temperature: float, repeat: int,
              progress=None, peers: tuple = ()) -> dict:
    """``peers``: callables item -> runs (other libraries on the same prompt), run right after specdec's
    modes for each prompt of the first pass, so machine drift hits them alike; each gets the same warm-up
    as specdec (``warm_up(prompt)``) before the first timed run."""
    from specdec.runners.huge_pages import settle
    from specdec.sampling.processors import SamplingConfig

    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    sampling = SamplingConfig(temperature=temperature)
    settle()  # nothing is timed while the load's packed weights move to 2 MiB pages (runners/huge_pages.py)
    progress("calibrating pass costs (target over T = 1..9 tokens, draft step)")
    costs = decoder.costs()
    progress("verify cost c(T)/c(1): " + ", ".join(f"T={t + 1} {r:.2f}x" for t, r in enumerate(costs.relative_curve()))
             + f"; draft step {costs.draft_step / costs.verify[0]:.2f}x of a target step")
    costs_by_context = {CALIBRATION_CONTEXT: costs}
    context = decode_context(decoder, prompts, max_new_tokens, len(costs.verify))
    if context >= LONG_CONTEXT:  # a long-context set: also time the passes behind that many cached tokens
        progress(f"calibrating pass costs again at context {context} (this prompt set's median)")
        costs_by_context[context] = calibrate(decoder.target, decoder.draft, max_tokens=len(costs.verify),
                                              context=context)
    warm_up = prompts[0]["prompt"]
    decoder.generate(warm_up, max_new_tokens=WARM_UP_TOKENS, sampling=sampling, num_draft_tokens=0)
    for peer in peers:
        peer.warm_up(warm_up, WARM_UP_TOKENS)
    runs = []
    total = repeat * len(prompts) * len(modes)
    done = 0
    labels = list(modes)
    for rep in range(repeat):
        for index, item in enumerate(prompts):
            shift = (index + rep) % len(labels)
            for mode in labels[shift:] + labels[:shift]:
                start_cold(decoder)
                result = decoder.generate(item["prompt"], max_new_tokens=max_new_tokens, sampling=sampling,
                                          seed=rep, **modes[mode])
                done += 1
                stats = result.stats
                runs.append({"prompt": item["id"], "kind": item["kind"], "mode": str(mode), "repeat": rep,
                             "tokens": result.token_ids, **stats.as_dict(), "rss_mib": current_rss_mib()})
                progress(f"[{done}/{total}] {item['id']} draft={mode}: {stats.tokens_per_s:.1f} tok/s, "
                         f"accepted/proposed {stats.acceptance_rate:.2f}")
            for peer in peers:  # a peer with ``repeats`` runs every pass (spread), the others the first
                if rep == 0 or getattr(peer, "repeats", False):
                    runs += [{**run, "repeat": rep, "rss_mib": run.get("rss_mib") or current_rss_mib()}
                             for run in peer(item)]
    summary = summarize(runs, costs_by_context, temperature)
    return {"costs": _costs_dict(costs),
            "costs_by_context": {str(ctx): _costs_dict(c) for ctx, c in costs_by_context.items()},
            "max_new_tokens": max_new_tokens, "temperature": temperature, "repeat": repeat,
            "modes": modes, "runs": runs, "peak_rss_mib": peak_rss_mib(), "summary": summary,
            "spread": repeat_spread(runs), "default_against_others": default_against_others(modes, summary)}


DEFAULT_MODE = {"num_draft_tokens": "auto"}  # the default configuration: auto lengths, the default proposer


def default_against_others(modes: dict, summary: list) -> dict:
    """kind -> {"ratio": the default mode's decode rate over the best other specdec mode's of the run, "best": that
    mode}; {} unless ``modes`` holds the default (``DEFAULT_MODE``) and another mode. Peers (llama.cpp, OpenVINO)
    are not among the others: the ratio says what the default's per-round choice lost (below 1) or gained (above)
    against running one of this library's modes throughout."""
    default = next((str(label) for label, options in modes.items() if options == DEFAULT_MODE), None)
    others = [str(label) for label in modes if str(label) != default]
    if default is None or not others:
        return {}
    rates = {(row["kind"], row["mode"]): row["tokens_per_s"] for row in summary}
    result = {}
    for kind in dict.fromkeys(row["kind"] for row in summary):
        best_rate, best = max(((rates.get((kind, mode)) or 0.0, mode) for mode in others))
        if rates.get((kind, default)) and best_rate > 0:
            result[kind] = {"ratio": rates[(kind, default)] / best_rate, "best": best}
    return result


def repeat_spread(runs: list) -> dict:
    """mode -> decode tok/s of each pass (summed tokens / summed decode seconds over that pass's prompts),
    their mean and sample standard deviation (None with one pass)."""
    import statistics

    spread = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        per_pass = []
        for rep in sorted({r["repeat"] for r in runs if r["mode"] == mode}):
            chosen = [r for r in runs if r["mode"] == mode and r["repeat"] == rep]
            seconds = sum(r["decode_seconds"] for r in chosen)
            per_pass.append(sum(r.get("decode_tokens", r["new_tokens"]) for r in chosen) / max(seconds, 1e-9))
        spread[mode] = {"tokens_per_s": per_pass, "mean": statistics.fmean(per_pass),
                        "stdev": statistics.stdev(per_pass) if len(per_pass) > 1 else None}
    return spread


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def start_cold(decoder) -> None:
    """Before a timed run: the run prefills from token 0 (no mode inherits another's KV cache), finds no earlier
    run's output to match in the suffix store, and its draft probes start without credit from earlier runs."""
    decoder.clear_cache()
    if getattr(decoder, "suffix_cache", None) is not None:
        decoder.suffix_cache.clear()
    if getattr(decoder, "probe_budget", None) is not None:
        decoder.probe_budget.reset()


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Hardware", "Model"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


def git_commit(where: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding this package (None outside git); ``-dirty`` when the
    work tree differs from it."""
    import subprocess

    where = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(bundle, threads: int | None) -> dict:
    """What a result depends on besides its options: code, packages, machine, bundle."""
    import hashlib
    import platform

    manifest = Path(bundle) / "manifest.json"
    try:
        bundle_hash = hashlib.sha256(manifest.read_bytes()).hexdigest()
    except OSError:
        bundle_hash = None
    return {"git_commit": git_commit(), "python": platform.python_version(),
            "packages": {name: _version(name) for name in ("specdec", "onnxruntime", "numpy", "tokenizers")},
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": threads or os.cpu_count(),
            "bundle_manifest_sha256": bundle_hash}


def _costs_dict(costs: Costs) -> dict:
    return {"draft_step": costs.draft_step, "verify": list(costs.verify)}


def decode_context(decoder, prompts: list, max_new_tokens: int, widest_pass: int) -> int:
    """The median number of cached tokens while decoding: prompt tokens + half the new tokens."""
    lengths = sorted(len(decoder.codec.encode(item["prompt"])) for item in prompts)
    limit = decoder.target.max_context - widest_pass - 1
    return min(lengths[len(lengths) // 2] + max_new_tokens // 2, limit)


def current_rss_mib() -> float | None:
    """This process's resident memory now (Linux /proc), else its peak so far (getrusage), in MiB."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        return peak_rss_mib()


def peak_rss_mib() -> float | None:
    try:
        import resource
    except ImportError:  # not on this platform (Windows)
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def rejected_rounds(run: dict) -> int | None:
    """Rounds of ``run`` whose proposal met a rejection, when its counts determine it (None otherwise).

    From ``GenerationStats.rejected_rounds`` when the decoder records it; a fixed chain of g=1
    proposes one token per round, so there it is proposed - accepted."""
    if run.get("rejected_rounds") is not None:
        return run["rejected_rounds"]
    if run["mode"] == "1" and run.get("proposed") is not None:
        return run["proposed"] - run["accepted"]
    return None


def _total(chosen: list, key: str):
    """Sum of ``key`` over runs, or None when any run lacks it (a peer that cannot report it)."""
    values = [r.get(key) for r in chosen]
    return None if any(v is None for v in values) else sum(values)


def _closest(costs_by_context: dict, context: float) -> Costs:
    return costs_by_context[min(costs_by_context, key=lambda ctx: abs(ctx - context))]


def summarize(runs: list, costs_by_context, temperature: float) -> list:
    """One row per (kind, mode), kinds plus 'all'. ``costs_by_context``: {context: Costs} (or one Costs);
    a row's prediction uses the costs calibrated closest to its runs' mean decode context.

    Speedups are ratios of summed times over the same prompts: decode-only (the decode loop) and
    end-to-end (prefill + decode: speculative modes also prefill the draft). Peers' counts they
    cannot report (acceptance, passes) are None."""
    if isinstance(costs_by_context, Costs):
        costs_by_context = {CALIBRATION_CONTEXT: costs_by_context}
    baseline = {(r["prompt"], r["repeat"]): r for r in runs if r["mode"] == "0"}

    def baseline_of(run):  # peers run once (repeat 0): compare with specdec's target-only run of that prompt
        return baseline.get((run["prompt"], run["repeat"])) or baseline[(run["prompt"], 0)]

    def rate(chosen, seconds_keys, tokens_key="new_tokens"):
        seconds = [sum(r[k] for k in seconds_keys) if all(r.get(k) is not None for k in seconds_keys) else None
                   for r in chosen]
        if any(s is None for s in seconds):
            return None
        return sum(r.get(tokens_key, r["new_tokens"]) for r in chosen) / max(sum(seconds), 1e-9)

    kinds = sorted({r["kind"] for r in runs}) + ["all"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    rows = []
    for kind in kinds:
        for mode in modes:
            chosen = [r for r in runs if r["mode"] == mode and (kind == "all" or r["kind"] == kind)]
            if not chosen:
                continue
            base = [baseline_of(r) for r in chosen]
            decode_rate = rate(chosen, ("decode_seconds",), "decode_tokens")
            e2e_rate = rate(chosen, ("prefill_seconds", "decode_seconds"))
            base_decode, base_e2e = rate(base, ("decode_seconds",)), rate(base, ("prefill_seconds", "decode_seconds"))
            tokens = sum(r["new_tokens"] for r in chosen)
            proposed, accepted, rounds = (_total(chosen, key) for key in ("proposed", "accepted", "rounds"))
            rejections = [rejected_rounds(r) for r in chosen]
            acceptance = None
            if accepted is not None and proposed and all(n is not None for n in rejections):
                acceptance = per_token_acceptance(accepted, sum(rejections))
            predicted = None
            if mode.isdigit() and mode != "0" and acceptance is not None:
                context = sum(r.get("prompt_tokens", 0) + r["new_tokens"] / 2 for r in chosen) / len(chosen)
                predicted = expected_speedup(min(acceptance, 0.999999), int(mode), _closest(costs_by_context, context))
            in_run = None  # the same formula on this run's own pass times: calibration error vs estimator error
            if predicted is not None and rounds and proposed and _total(base, "rounds"):
                c1 = _total(base, "verify_seconds") / _total(base, "rounds")
                in_run = expected_speedup(min(acceptance, 0.999999), int(mode), Costs(
                    _total(chosen, "draft_seconds") / proposed, (c1,) * int(mode) + (_total(chosen, "verify_seconds") / rounds,)))
            identical = sum(r["tokens"] == b["tokens"] for r, b in zip(chosen, base)) if temperature == 0 else None
            rss = [r.get("rss_mib") for r in chosen if r.get("rss_mib") is not None]
            rows.append({
                "kind": kind, "mode": mode, "runs": len(chosen), "tokens_per_s": decode_rate,
                "speedup": decode_rate / base_decode if decode_rate else None,  # decode-only
                "end_to_end_speedup": e2e_rate / base_e2e if e2e_rate else None,
                "predicted_speedup": predicted, "predicted_from_run_passes": in_run,
                "acceptance": acceptance,  # per token: accepted / (accepted + rounds with a rejection)
                "accepted_per_proposed": accepted / proposed if proposed else None,
                "accepted_per_round": accepted / rounds if accepted is not None and rounds else None,
                "tokens_per_target_pass": tokens / rounds if rounds else None,  # one verify pass per round
                "prefill_s": _total(chosen, "prefill_seconds"), "draft_s": _total(chosen, "draft_seconds"),
                "verify_s": _total(chosen, "verify_seconds"), "host_s": _total(chosen, "host_seconds"),
                "rss_mib": max(rss) if rss else None, "identical_to_target_only": identical,
            })
    return rows


def _cell(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mode_name(mode: str) -> str:
    return {"0": "target only"}.get(mode, mode if not mode.isdigit() else f"draft g={mode}")


def markdown(report: dict) -> str:
    lines = [
        "| kind | mode | tok/s | decode speedup | predicted | predicted (run's passes) | end-to-end speedup | "
        "acceptance / token | accepted/proposed | accepted/round | tokens/target pass | prefill s | draft s | "
        "verify s | host s | RSS MiB | greedy == target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    spread = report.get("spread") or {}
    for row in report["summary"]:
        tok_s = _cell(row["tokens_per_s"])
        mode_spread = spread.get(row["mode"]) or {}
        if row["kind"] == "all" and mode_spread.get("stdev") is not None:
            tok_s = f"{mode_spread['mean']:.2f} ± {mode_spread['stdev']:.2f}"
        identical = f"{row['identical_to_target_only']}/{row['runs']}" if row["identical_to_target_only"] is not None else "-"
        mode = _mode_name(row["mode"])
        lines.append(
            f"| {row['kind']} | {mode} | {tok_s} | {_cell(row['speedup'], '.2f', 'x')} | "
            f"{_cell(row['predicted_speedup'], '.2f', 'x')} | {_cell(row['predicted_from_run_passes'], '.2f', 'x')} | "
            f"{_cell(row['end_to_end_speedup'], '.2f', 'x')} | "
            f"{_cell(row['acceptance'])} | {_cell(row['accepted_per_proposed'])} | {_cell(row['accepted_per_round'])} | "
            f"{_cell(row['tokens_per_target_pass'])} | {_cell(row['prefill_s'], '.1f')} | {_cell(row['draft_s'], '.1f')} | "
            f"{_cell(row['verify_s'], '.1f')} | {_cell(row['host_s'], '.2f')} | {_cell(row['rss_mib'], '.0f')} | {identical} |"
        )
    against = default_against_others(report.get("modes") or {}, report["summary"])
    if against:
        lines.append("")
        lines.append("The default (auto) against the best other mode of this run, decode tok/s: " + ", ".join(
            f"{kind} {entry['ratio']:.2f}x ({_mode_name(entry['best'])})" for kind, entry in against.items()) + ".")
    lines.append("")
    lines.append("Decode speedup: decode loop only; end-to-end: prefill included (speculative modes also prefill the "
                 "draft). Predicted: Leviathan et al.'s speedup from the calibrated pass costs and the per-token "
                 "acceptance accepted / (accepted + rounds with a rejection); run's passes: the same formula on "
                 "this run's own mean pass times (target-only c(1), this mode's c(g+1) and draft step).")
    by_context = report.get("costs_by_context") or {str(CALIBRATION_CONTEXT): report["costs"]}
    short = by_context.get(str(CALIBRATION_CONTEXT), report["costs"])
    for context, costs in by_context.items():
        curve = ", ".join(f"T={t + 1}: {c / costs['verify'][0]:.2f}x" for t, c in enumerate(costs["verify"]))
        lines.append(f"Context {context}: target pass cost relative to its T=1: {curve}. Draft step: "
                     f"{costs['draft_step'] / costs['verify'][0]:.2f}x of a target step. Target T=1 pass "
                     f"{costs['verify'][0] / short['verify'][0]:.2f}x, draft step "
                     f"{costs['draft_step'] / max(short['draft_step'], 1e-12):.2f}x their cost at context "
                     f"{CALIBRATION_CONTEXT}.")
    weights = memory_rate_line(report.get("weights_per_token") or {}, report["summary"])
    if weights:
        lines.append(weights)
    if any((s or {}).get("stdev") is not None for s in spread.values()):
        lines.append("tok/s of the 'all' rows with several passes: mean ± sample stddev of the passes' decode rates "
                     "(each pass: summed tokens / summed decode seconds).")
    llama = report.get("llama_server")
    if llama:
        lines.append("llama.cpp rows (llama:*): llama-server, one process per mode on the bundle's source GGUF, timed "
                     "by its own /completion timings (decode: predicted_n / predicted_ms; prefill: prompt_ms); RSS: "
                     "the server's peak (VmHWM). " + " ".join(llama.get("notes", [])))
    openvino = report.get("openvino")
    if openvino:
        first = next((v for k, v in openvino.items() if k != "notes"), {})  # every mode's job has the same options
        given = first.get("job", {}).get("properties")
        properties = json.dumps(given) if given else "its defaults"
        version = first.get("version") or "?"
        lines.append(f"OpenVINO GenAI {version} rows (ov:*): an LLMPipeline per mode in its own process on the same "
                     "GGUFs, with "
                     f"{properties}; prefill: its time to first token; decode: the rest of the generate call over the "
                     "remaining tokens; RSS: the worker's peak. " + " ".join(openvino.get("notes", [])))
    info = report.get("provenance")
    if info:
        packages = ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v)
        lines.append(f"Commit {info['git_commit'] or '-'}; {packages}; Python {info['python']}; CPU {info['cpu']} "
                     f"({info['cpu_count']} cores), {info['threads']} threads; bundle manifest sha256 "
                     f"{(info['bundle_manifest_sha256'] or '-')[:16]}.")
    if report.get("peak_rss_mib") is not None:
        lines.append(f"Peak RSS of the bench process: {report['peak_rss_mib']:.0f} MiB.")
    if report.get("load_order"):
        lines.append(f"Models loaded: {report['load_order']} (the creation order can move pass times: "
                     "compare runs with and without --peers-first).")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Speedup against draft length as a PNG at ``path``; False when the report has no rows to plot. Without
    matplotlib (the [bench] extra) an ImportError saying so: the plot is optional, the tables are not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("matplotlib is not installed (pip install 'specdec[bench]')") from None
    rows = [r for r in report["summary"] if r["kind"] == "all" and r["mode"].isdigit() and r["mode"] != "0"]
    if not rows:
        return False
    gammas = [int(r["mode"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(gammas, [r["speedup"] for r in rows], "o-", label="measured (decode)")
    ax.plot(gammas, [r["end_to_end_speedup"] for r in rows], "^-", label="measured (end-to-end)")
    predicted = [(g, r["predicted_speedup"]) for g, r in zip(gammas, rows) if r["predicted_speedup"] is not None]
    if predicted:
        ax.plot(*zip(*predicted), "s--", label="predicted (cost model)")
    auto = [r for r in report["summary"] if r["kind"] == "all" and r["mode"] == "auto"]
    if auto and auto[0]["speedup"] is not None:
        ax.axhline(auto[0]["speedup"], color="green", linestyle=":", label="auto (measured, decode)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft tokens per round (g)")
    ax.set_ylabel("speedup vs target-only")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
