"""``specdec demo``: the main job on the default real pair, end to end (runtime + export: lives above both).

Exports the pinned Qwen2.5-Coder pair as int4 the first time (needs the ``[export,pair]``
extras; third-party warnings and progress bars silenced, specdec's own progress lines kept), then
runs two tasks, a code completion and an edit (a chat request whose answer repeats most of its
input), each in three modes: target only, the draft model, and ``auto`` (the default: per round a
suffix tree of the prompt and the output so far, a draft chain, or nothing). Greedy, so every mode
must give target-only's tokens; each mode runs ``--repeat`` times, in turn with the others, after
one warm-up, and its mean decode tok/s and the speedup over target only are printed, whatever they
are. Every run starts cold, as the bench's do: no KV cache kept from an earlier run and an empty
store of earlier outputs (else ``auto`` would match the warm-up's answer and look better than a
first request does).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

COMPLETION = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number, computed iteratively."""
'''
EDIT_CODE = '''def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users
'''
EDIT = ("Add type hints and a one-line docstring to this function. Reply with the whole function only, in a "
        "python code block.\n\n```python\n" + EDIT_CODE + "```")
MODES = (("target only", {"num_draft_tokens": 0}), ("draft model", {"num_draft_tokens": "auto", "proposer": "draft"}),
         ("auto (default)", {"num_draft_tokens": "auto"}))
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
         "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}


def default_bundle() -> Path:
    from specdec.contract.bundle import cache_dir

    return cache_dir() / "bundles" / "qwen2.5-coder-int4"


def ensure_bundle(bundle: Path) -> None:
    if (bundle / "manifest.json").is_file():
        return
    try:
        from specdec.export.bundle import ExportOptions, Progress, export_bundle
        from specdec.export.pair import DEFAULT_PAIR, pair_sources
    except ImportError as exc:
        raise ValueError(f"{exc.name} is missing: the first run exports the pair, pip install -e '.[export,pair]'") from None
    os.environ.update(QUIET)  # the export's worker processes inherit it: no screens of third-party warnings
    import warnings

    warnings.filterwarnings("ignore")
    progress = Progress()
    progress(f"no bundle at {bundle}: exporting the default pair ({DEFAULT_PAIR}, int4); this takes several minutes")
    target, draft = pair_sources(DEFAULT_PAIR, progress)
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=bundle, quant="int4"), progress)


def add_demo_parser(commands) -> None:
    demo = commands.add_parser("demo", help="export the default real pair if needed; a completion and an edit task, "
                                            "each mode's tok/s and speedup")
    demo.add_argument("--bundle", default=None, help="bundle folder (default: the cache's qwen2.5-coder-int4)")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--repeat", type=int, default=2, help="timed runs per task and mode (default 2)")
    demo.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    rows = demo.add_mutually_exclusive_group()
    rows.add_argument("--exact-rows", dest="exact_rows", action="store_const", const=True, default=None,
                      help="always run one-token passes as two rows (default: where this CPU needs it; see generate)")
    rows.add_argument("--no-exact-rows", dest="exact_rows", action="store_const", const=False,
                      help="never: faster where one-token passes round otherwise, modes may then differ on near-ties")


def _tasks(decoder) -> list:
    """(name, prompt token ids, stop ids): the completion as raw text, the edit through the chat template."""
    tasks = [("completion", decoder.codec.encode(COMPLETION), ())]
    try:
        from specdec.decoding.text.chat import chat_prompt

        prompt = chat_prompt(decoder, [{"role": "user", "content": EDIT}])
        tasks.append(("edit", list(prompt.ids), tuple(prompt.stop_token_ids)))
    except (ValueError, ImportError) as exc:  # no chat template / no jinja2: the completion alone
        print(f"edit task skipped: {exc}", file=sys.stderr)
    return tasks


def run_demo(decoder, max_new_tokens: int, repeat: int) -> list:
    """Rows of (task, mode, mean tok/s, speedup vs target only, acceptance, same tokens as target only), and the
    target-only text of each task."""
    from specdec.bench.bench import start_cold
    from specdec.sampling.processors import SamplingConfig

    greedy = SamplingConfig(temperature=0.0)
    rows, texts = [], {}
    for task, ids, stop in _tasks(decoder):
        runs = {mode: [] for mode, _ in MODES}
        for index in range(repeat + 1):  # run 0 warms up (and calibrates auto's pass costs), untimed
            order = MODES if index % 2 else tuple(reversed(MODES))
            for mode, options in order:
                start_cold(decoder)  # as the bench's runs: no earlier run's cache or output
                result = decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=greedy, stop_token_ids=stop,
                                          **options)
                if index:
                    runs[mode].append(result)
        base = runs["target only"][0]
        texts[task] = decoder.codec.decode(base.token_ids)
        base_rate = statistics.mean(r.stats.tokens_per_s for r in runs["target only"])
        for mode, _ in MODES:
            rate = statistics.mean(r.stats.tokens_per_s for r in runs[mode])
            acceptance = statistics.mean(r.stats.acceptance_rate for r in runs[mode]) if mode != "target only" else None
            same = all(r.token_ids == base.token_ids for r in runs[mode])
            rows.append((task, mode, rate, rate / max(base_rate, 1e-9), acceptance, same, len(base.token_ids)))
    return rows, texts


def cmd_demo(args) -> int:
    from specdec.decoding.decoder import SpeculativeDecoder

    if args.repeat < 1 or args.max_new_tokens < 1:
        raise ValueError("--repeat and --max-new-tokens must be >= 1")
    bundle = Path(args.bundle) if args.bundle else default_bundle()
    from specdec.runners.standard import session_options

    session_options(args.threads)  # size the process's thread pool now: the export's checks would size it first
    ensure_bundle(bundle)
    decoder = SpeculativeDecoder.load(bundle, threads=args.threads, exact_rows=args.exact_rows)
    rows, texts = run_demo(decoder, args.max_new_tokens, args.repeat)
    for task, text in texts.items():
        shown = COMPLETION + text if task == "completion" else text
        print(f"--- {task} (greedy; every mode gave these tokens unless marked below)\n{shown.rstrip()}\n")
    print(f"{'task':<11} {'mode':<15} {'tok/s':>6} {'vs target only':>15} {'acceptance':>11}  same tokens")
    for task, mode, rate, speedup, acceptance, same, count in rows:
        accepted = f"{acceptance:.2f}" if acceptance is not None else "-"
        print(f"{task:<11} {mode:<15} {rate:6.1f} {speedup:14.2f}x {accepted:>11}  {'yes' if same else 'NO'}")
    print(f"(decode tok/s, prefill excluded; mean of {args.repeat} run(s) per mode after a warm-up, modes taking turns; "
          f"{os.cpu_count()} CPUs{'' if args.threads is None else f', {args.threads} threads'})")
    if decoder.rows_exact is False:
        print("(on this CPU a one-token int4 pass rounds unlike a row of a wider pass, so a mode marked NO is a greedy "
              "decoding that parted from target-only's on a near-tie; without --no-exact-rows every mode's tokens are "
              "equal, at a two-token pass's cost per one-token pass)")
    elif decoder.target.pad_one_row and args.exact_rows is None:
        print("(on this CPU a one-token int4 pass rounds unlike a row of a wider pass: one-token passes ran as two rows "
              "so that every mode's greedy tokens equal target-only's)")
    return 0
