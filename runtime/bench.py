"""``specdec bench``: speculative vs target-only, side by side in one process, on the same prompts.

Modes (draft lengths, "auto", 0 = target-only) run interleaved per prompt, in a rotating
order, for ``--repeat`` passes, so machine noise hits every mode alike. Reported per mode and
prompt kind: decode tokens/s, speedup vs target-only (ratio of summed decode times for the
same prompts), acceptance, mean accepted per round, time split, the cost model's predicted
speedup, and (greedy) how many outputs are token-identical to target-only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .cost_model import expected_speedup


def add_bench_parser(commands) -> None:
    from .cli_args import add_load_args

    bench = commands.add_parser("bench", help="speculative vs target-only on a prompt set")
    bench.add_argument("bundle")
    bench.add_argument("--prompts", required=True, help="JSON list of {id, kind, prompt}")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--draft-tokens", default="0,1,2,4,auto", help="comma list of draft lengths and/or auto")
    bench.add_argument("--proposers", default="", help="extra modes: comma list of lookup,hybrid (draft length auto)")
    bench.add_argument("--trees", default="", help="extra modes: semicolon list of tree shapes, e.g. '2,2,1;auto'")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--repeat", type=int, default=1)
    bench.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    bench.add_argument("--peer-transformers", nargs=2, metavar=("TARGET", "DRAFT"),
                       help="also time Hugging Face transformers target-only and assisted generation on this pair "
                            "(local folders or .gguf files; needs torch)")
    bench.add_argument("--peer-genai", metavar="MODEL_DIR",
                       help="also time onnxruntime-genai target-only and n-gram speculation on a folder its model "
                            "builder made from the same target (needs onnxruntime-genai)")
    add_load_args(bench)


def _decoder_limits() -> dict:
    """The decoder's own limits, so bench refuses exactly what generate() would refuse."""
    from . import request

    return {"max_draft": request.MAX_DRAFT_TOKENS, "max_tree_nodes": request.MAX_TREE_NODES,
            "proposers": request.PROPOSERS}


def build_modes(draft_tokens: str, proposers: str = "", trees: str = "") -> dict:
    """label -> generate() keyword arguments; "0" (target-only) is always first.

    Every item is checked here, before anything runs: draft lengths in 0..MAX_DRAFT_TOKENS or "auto",
    known proposers, tree shapes that parse and fit in one verify pass. Errors are one ValueError line
    naming the option.
    """
    from .tree import AUTO_TREE_BUDGET, parse_tree, tree_size

    limits = _decoder_limits()
    modes = {"0": {"num_draft_tokens": 0}}
    for item in filter(None, (part.strip() for part in draft_tokens.split(","))):
        if item == "auto":  # the product default: auto lengths, hybrid proposals
            modes["auto"] = {"num_draft_tokens": "auto"}
            continue
        try:
            length = int(item)
        except ValueError:
            length = -1
        if not 0 <= length <= limits["max_draft"]:
            raise ValueError(f"--draft-tokens: {item!r} is not a draft length (an integer in 0..{limits['max_draft']}"
                             " or auto)")
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
    if (args.peer_transformers or args.peer_genai) and args.temperature != 0:
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
    from .sampling import SamplingConfig

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
    modes for each prompt of the first pass, so machine drift hits them alike."""
    from .sampling import SamplingConfig

    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    sampling = SamplingConfig(temperature=temperature)
    progress("calibrating pass costs (target over T = 1..9 tokens, draft step)")
    costs = decoder.costs()
    progress("verify cost c(T)/c(1): " + ", ".join(f"T={t + 1} {r:.2f}x" for t, r in enumerate(costs.relative_curve()))
             + f"; draft step {costs.draft_step / costs.verify[0]:.2f}x of a target step")
    decoder.generate(prompts[0]["prompt"], max_new_tokens=8, sampling=sampling, num_draft_tokens=0)  # warm-up
    runs = []
    total = repeat * len(prompts) * len(modes)
    done = 0
    labels = list(modes)
    for rep in range(repeat):
        for index, item in enumerate(prompts):
            shift = (index + rep) % len(labels)
            for mode in labels[shift:] + labels[:shift]:
                result = decoder.generate(item["prompt"], max_new_tokens=max_new_tokens, sampling=sampling,
                                          seed=rep, **modes[mode])
                done += 1
                stats = result.stats
                runs.append({"prompt": item["id"], "kind": item["kind"], "mode": str(mode), "repeat": rep,
                             "tokens": result.token_ids, **stats.as_dict()})
                progress(f"[{done}/{total}] {item['id']} draft={mode}: {stats.tokens_per_s:.1f} tok/s, "
                         f"acceptance {stats.acceptance_rate:.2f}")
            if rep == 0:
                for peer in peers:
                    runs += peer(item)
    return {"costs": {"draft_step": costs.draft_step, "verify": list(costs.verify)},
            "max_new_tokens": max_new_tokens, "temperature": temperature, "repeat": repeat,
            "modes": modes, "runs": runs, "summary": summarize(runs, costs, temperature)}


def summarize(runs: list, costs, temperature: float) -> list:
    """One row per (kind, mode), kinds plus 'all'."""
    baseline = {(r["prompt"], r["repeat"]): r for r in runs if r["mode"] == "0"}

    def baseline_of(run):  # peers run once (repeat 0): compare with specdec's target-only run of that prompt
        return baseline.get((run["prompt"], run["repeat"])) or baseline[(run["prompt"], 0)]

    kinds = sorted({r["kind"] for r in runs}) + ["all"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    rows = []
    for kind in kinds:
        for mode in modes:
            chosen = [r for r in runs if r["mode"] == mode and (kind == "all" or r["kind"] == kind)]
            if not chosen:
                continue
            base = [baseline_of(r) for r in chosen]
            tokens = sum(r["new_tokens"] for r in chosen)
            seconds = sum(r["decode_seconds"] for r in chosen)
            base_rate = sum(b["new_tokens"] for b in base) / max(sum(b["decode_seconds"] for b in base), 1e-9)
            rate = tokens / max(seconds, 1e-9)
            proposed = sum(r["proposed"] for r in chosen)
            accepted = sum(r["accepted"] for r in chosen)
            acceptance = accepted / proposed if proposed else 0.0
            rounds = sum(r["rounds"] for r in chosen)
            predicted = None
            if mode.isdigit() and mode != "0":
                predicted = expected_speedup(min(acceptance, 0.999999), int(mode), costs)
            identical = sum(r["tokens"] == b["tokens"] for r, b in zip(chosen, base)) if temperature == 0 else None
            rows.append({
                "kind": kind, "mode": mode, "runs": len(chosen), "tokens_per_s": rate, "speedup": rate / base_rate,
                "predicted_speedup": predicted, "acceptance": acceptance,
                "accepted_per_round": accepted / rounds if rounds else 0.0,
                "tokens_per_target_pass": tokens / max(rounds, 1),  # one verify pass per round
                "draft_s": sum(r["draft_seconds"] for r in chosen), "verify_s": sum(r["verify_seconds"] for r in chosen),
                "host_s": sum(r["host_seconds"] for r in chosen), "identical_to_target_only": identical,
            })
    return rows


def markdown(report: dict) -> str:
    lines = [
        "| kind | mode | tok/s | speedup | predicted | acceptance | accepted/round | tokens/target pass | draft s | verify s | host s | greedy == target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        predicted = f"{row['predicted_speedup']:.2f}x" if row["predicted_speedup"] else "-"
        identical = f"{row['identical_to_target_only']}/{row['runs']}" if row["identical_to_target_only"] is not None else "-"
        mode = {"0": "target only"}.get(row["mode"], row["mode"] if not row["mode"].isdigit() else f"draft g={row['mode']}")
        lines.append(
            f"| {row['kind']} | {mode} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | {predicted} | "
            f"{row['acceptance']:.2f} | {row['accepted_per_round']:.2f} | {row['tokens_per_target_pass']:.2f} | {row['draft_s']:.1f} | {row['verify_s']:.1f} | "
            f"{row['host_s']:.2f} | {identical} |"
        )
    curve = ", ".join(f"T={t + 1}: {c / report['costs']['verify'][0]:.2f}x" for t, c in enumerate(report["costs"]["verify"]))
    lines.append("")
    lines.append(f"Target pass cost relative to T=1: {curve}. Draft step: "
                 f"{report['costs']['draft_step'] / report['costs']['verify'][0]:.2f}x of a target step.")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["summary"] if r["kind"] == "all" and r["mode"].isdigit() and r["mode"] != "0"]
    if not rows:
        return False
    gammas = [int(r["mode"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(gammas, [r["speedup"] for r in rows], "o-", label="measured")
    ax.plot(gammas, [r["predicted_speedup"] for r in rows], "s--", label="predicted (cost model)")
    auto = [r for r in report["summary"] if r["kind"] == "all" and r["mode"] == "auto"]
    if auto:
        ax.axhline(auto[0]["speedup"], color="green", linestyle=":", label="auto (measured)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft tokens per round (g)")
    ax.set_ylabel("speedup vs target-only")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cmd_bench(args) -> int:
    from .decoder import SpeculativeDecoder

    # everything is checked before the first run: a bad option never costs the runs before it
    check_bench_args(args)
    prompts = load_prompts(args.prompts, args.limit)
    modes = build_modes(args.draft_tokens, args.proposers, args.trees)
    check_writable(Path(args.out))
    started = time.perf_counter()
    decoder = SpeculativeDecoder.load(args.bundle, provider=args.provider, max_context=args.max_context,
                                      threads=args.threads, verify=not args.no_verify)
    preflight(decoder, prompts, modes, args.max_new_tokens, args.temperature)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    peers = []
    if args.peer_genai:
        from .peers import GenaiPeer

        peers.append(GenaiPeer(args.peer_genai, decoder.codec.encode, args.max_new_tokens, say, args.threads))
    if args.peer_transformers:
        from .peers import TransformersPeer

        peers.append(TransformersPeer(*args.peer_transformers, decoder.codec.encode, args.max_new_tokens, say))
    report = run_bench(decoder, prompts, modes, args.max_new_tokens, args.temperature, args.repeat, peers=tuple(peers))
    report["command"] = " ".join(sys.argv)
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "bench.md").write_text(table)
    plotted = plot(report, out / "bench.png")
    print(table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""))
    return 0
