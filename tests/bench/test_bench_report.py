"""Bench reporting: the prediction's estimator, decode vs end-to-end speedups, peers' unknowns, RSS, long context."""

import numpy as np
import pytest

from specdec.bench import bench
from specdec.bench.bench import markdown, summarize
from specdec.decoding.cost_model import Costs, expected_speedup

COSTS = Costs(draft_step=0.3, verify=(1.0, 1.04, 1.22, 1.43, 1.65, 1.87, 2.09, 2.30, 2.52))  # int4 pair, issue 13


def _run(prompt, mode, new_tokens, decode_seconds, prefill_seconds=0.1, **counts):
    return {"prompt": prompt, "kind": "code", "mode": mode, "repeat": 0, "tokens": [1] * new_tokens,
            "prompt_tokens": 100, "new_tokens": new_tokens, "decode_seconds": decode_seconds,
            "prefill_seconds": prefill_seconds, "draft_seconds": 0.0, "verify_seconds": decode_seconds,
            "host_seconds": 0.0, "rounds": counts.get("rounds", new_tokens), "proposed": counts.get("proposed", 0),
            "accepted": counts.get("accepted", 0), **{k: v for k, v in counts.items() if k == "rejected_rounds"}}


def _simulated_runs(gamma, acceptance, rounds, seed, keep_rejections=True):
    """A speculative run and its target-only baseline timed by COSTS: each draft token accepted with
    probability ``acceptance`` until the first rejection; decode time = the rounds' pass costs."""
    rng = np.random.default_rng(seed)
    tokens = accepted = rejections = 0
    for _ in range(rounds):
        run = 0
        while run < gamma and rng.random() < acceptance:
            run += 1
        accepted += run
        rejections += run < gamma
        tokens += run + 1
    seconds = rounds * (gamma * COSTS.draft_step + COSTS.verify_cost(gamma + 1))
    counts = {"rounds": rounds, "proposed": gamma * rounds, "accepted": accepted}
    if keep_rejections:
        counts["rejected_rounds"] = rejections
    base = _run("p", "0", tokens, tokens * COSTS.verify[0])
    return [base, _run("p", str(gamma), tokens, seconds, **counts)]


@pytest.mark.parametrize("gamma", [1, 2, 4, 6])
def test_prediction_matches_a_simulated_run_with_the_per_token_acceptance(gamma):
    """Runs timed exactly by the cost model: predicted == measured within 3%; accepted/proposed would miss for g>1."""
    runs = _simulated_runs(gamma, 0.8, 4000, seed=gamma)
    row = next(r for r in summarize(runs, COSTS, 0.0) if r["kind"] == "all" and r["mode"] == str(gamma))
    assert row["predicted_speedup"] == pytest.approx(row["speedup"], rel=0.03)
    assert row["predicted_from_run_passes"] == pytest.approx(row["predicted_speedup"], rel=1e-9)  # same pass costs
    assert row["acceptance"] == pytest.approx(0.8, abs=0.02)
    old = expected_speedup(row["accepted_per_proposed"], gamma, COSTS)  # the estimator the README used
    if gamma > 1:
        assert abs(old / row["speedup"] - 1) > 0.05


def test_rejections_are_derived_for_g1_and_missing_otherwise():
    """g=1 proposes one token a round (rejections = proposed - accepted); for g>1 without the count: '-'."""
    runs = _simulated_runs(1, 0.7, 500, seed=1, keep_rejections=False) + _simulated_runs(2, 0.7, 500, 2, False)[1:]
    rows = {r["mode"]: r for r in summarize(runs, COSTS, 0.0) if r["kind"] == "all"}
    assert rows["1"]["predicted_speedup"] is not None and rows["1"]["acceptance"] == pytest.approx(0.7, abs=0.05)
    assert rows["2"]["predicted_speedup"] is None and rows["2"]["acceptance"] is None
    assert rows["2"]["accepted_per_proposed"] is not None


def test_end_to_end_speedup_charges_the_drafts_prefill():
    """Same decode time, double prefill: decode speedup 1.25x, end-to-end lower."""
    runs = [_run("p", "0", 100, 10.0, prefill_seconds=1.0), _run("p", "2", 100, 8.0, prefill_seconds=2.0)]
    row = next(r for r in summarize(runs, COSTS, 0.0) if r["kind"] == "all" and r["mode"] == "2")
    assert row["speedup"] == pytest.approx(1.25)
    assert row["end_to_end_speedup"] == pytest.approx(11.0 / 10.0)


def test_peer_unknowns_print_as_dashes():
    """A peer's acceptance, passes and time split are None, shown as '-' (not 0 or a made-up 1.00)."""
    from specdec.bench.peers import _record

    item = {"id": "p", "kind": "code", "prompt": "x"}
    runs = [_run("p", "0", 100, 10.0), _record(item, "genai:ngram", [1] * 100, 0.1, 5.0, lambda m: None)]
    report = {"summary": summarize(runs, COSTS, 0.0), "costs": {"draft_step": 0.3, "verify": list(COSTS.verify)}}
    row = next(r for r in report["summary"] if r["kind"] == "all" and r["mode"] == "genai:ngram")
    assert row["speedup"] == pytest.approx(2.0)
    assert row["acceptance"] is None and row["tokens_per_target_pass"] is None and row["accepted_per_round"] is None
    line = next(line for line in markdown(report).splitlines() if "genai:ngram" in line and "| all |" in line)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[7:11] == ["-", "-", "-", "-"]  # acceptance / token, accepted/proposed, accepted/round, tokens/pass


def test_prediction_uses_the_costs_calibrated_nearest_the_runs_context():
    """A long-prompt row takes the costs measured at its context, a short one those at 256."""
    long_costs = Costs(draft_step=0.45, verify=tuple(1.0 + 2 * (c - 1.0) for c in COSTS.verify))  # steeper in T
    runs = _simulated_runs(2, 0.8, 200, seed=3)
    for run in runs:
        run["prompt_tokens"] = 1500
    short_row = next(r for r in summarize(runs, {256: COSTS}, 0.0) if r["mode"] == "2")
    long_row = next(r for r in summarize(runs, {256: COSTS, 1500: long_costs}, 0.0) if r["mode"] == "2")
    assert long_row["predicted_speedup"] == pytest.approx(expected_speedup(long_row["acceptance"], 2, long_costs))
    assert long_row["predicted_speedup"] != pytest.approx(short_row["predicted_speedup"])


def test_rss_is_measured_without_psutil():
    """Resident memory from /proc (or getrusage): a positive number of MiB."""
    assert bench.current_rss_mib() > 1 and bench.peak_rss_mib() >= bench.current_rss_mib() * 0.5


def test_run_bench_warms_peers_and_calibrates_long_sets_at_their_context(tiny_decoder, monkeypatch):
    """Each peer gets specdec's warm-up before its first timed run; a long-prompt set is also calibrated
    at its median context, and the markdown reports both contexts' pass costs."""
    calls = []

    class Peer:
        def warm_up(self, prompt, tokens):
            calls.append(("warm_up", tokens))

        def __call__(self, item):
            calls.append(("run", item["id"]))
            return []

    monkeypatch.setattr(bench, "LONG_CONTEXT", 100)
    prompts = [{"id": "long", "kind": "code", "prompt": "def f(x):\n    return x\n" * 8}]  # 184 characters
    report = bench.run_bench(tiny_decoder, prompts, {"0": {"num_draft_tokens": 0}, "2": {"num_draft_tokens": 2}},
                             8, 0.0, repeat=1, progress=lambda m: None, peers=(Peer(),))
    assert calls == [("warm_up", bench.WARM_UP_TOKENS), ("run", "long")]
    context = len(tiny_decoder.codec.encode(prompts[0]["prompt"])) + 8 // 2  # prompt + half the new tokens
    assert context > 100 and sorted(report["costs_by_context"]) == sorted([str(context), "256"])
    assert all(r["rss_mib"] > 0 for r in report["runs"])
    text = markdown(report)
    assert f"Context {context}:" in text and "Context 256:" in text


def test_long_context_prompts_are_cut_from_the_standard_library():
    """Each prompt is at most N tokens of a stdlib module's source or docs, ends at a line break; both kinds."""
    from specdec.bench.prompt_sets import long_context_prompts

    prompts = long_context_prompts(lambda text: [ord(c) for c in text], lambda ids: "".join(map(chr, ids)), 400)
    assert {p["kind"] for p in prompts} == {"long-code", "long-docs"} and len(prompts) >= 6
    assert all(300 < len(p["prompt"]) <= 400 and p["prompt"].endswith("\n") for p in prompts)
    assert len({p["id"] for p in prompts}) == len(prompts)


def test_the_default_is_compared_with_the_best_other_mode_of_each_kind():
    """Per kind, the default's decode rate over the best other specdec mode's (target only included), peers left
    out; nothing without the default or without another mode."""
    def run(prompt, kind, mode, seconds):
        return {**_run(prompt, mode, 100, seconds), "kind": kind}

    modes = {"0": {"num_draft_tokens": 0}, "auto": {"num_draft_tokens": "auto"},
             "auto:suffix": {"num_draft_tokens": "auto", "proposer": "suffix"}}
    runs = [run("c", "code", "0", 10.0), run("c", "code", "auto", 5.0), run("c", "code", "auto:suffix", 4.0),
            run("e", "edit", "0", 10.0), run("e", "edit", "auto", 4.0), run("e", "edit", "auto:suffix", 5.0),
            run("c", "code", "llama:target", 2.0), run("e", "edit", "llama:target", 2.0)]
    summary = summarize(runs, COSTS, 0.0)
    against = bench.default_against_others(modes, summary)
    assert against["code"] == {"ratio": pytest.approx(0.8), "best": "auto:suffix"}
    assert against["edit"] == {"ratio": pytest.approx(1.25), "best": "auto:suffix"}
    assert against["all"] == {"ratio": pytest.approx(1.0), "best": "auto:suffix"}
    text = markdown({"summary": summary, "modes": modes, "costs": {"draft_step": 0.3, "verify": list(COSTS.verify)}})
    assert "The default (auto) against the best other mode of this run, decode tok/s: code 0.80x (auto:suffix)" in text
    assert bench.default_against_others({"auto": modes["auto"]}, summary) == {}
    assert bench.default_against_others({k: modes[k] for k in ("0", "auto:suffix")}, summary) == {}


def test_the_report_reads_bytes_per_token_at_the_decode_rates():
    """Bytes a one-token pass reads times the decode rate (target only for specdec, llama.cpp plain for the GGUF);
    no line without the target's bytes, no GGUF part without its bytes."""
    from specdec.bench.weights_read import memory_rate_line

    summary = [{"kind": "all", "mode": "0", "tokens_per_s": 10.0}, {"kind": "all", "mode": "llama:target",
                                                                      "tokens_per_s": 20.0},
               {"kind": "code", "mode": "0", "tokens_per_s": 99.0}]
    target = {"form": "int8", "file": "target-int8/model.onnx", "streamed": 1000 * 2**20, "gathered": 0}
    line = memory_rate_line({"target": target, "gguf": {"file": "t.gguf", "bytes": 500 * 2**20}}, summary)
    assert line == ("Weights a one-token pass reads (as packed for onnxruntime's CPU kernels; tables read a row at a "
                    "time not counted): the target's int8 form 1,000.0 MiB, at 10.00 tok/s 10.5 GB/s (target only); "
                    "the GGUF t.gguf 500.0 MiB, at 20.00 tok/s 10.5 GB/s (llama.cpp plain).")
    bandwidth = {"read_bandwidth": {"gbs": 20.44, "processes": 2}}
    assert memory_rate_line({"target": target} | bandwidth, summary).endswith(
        "(target only); this machine reads 20.4 GB/s (2 processes summing their own arrays, before the models loaded).")
    assert memory_rate_line({}, summary) is None
    assert "GGUF" not in memory_rate_line({"target": target, "gguf": {"file": "t.gguf", "bytes": None}}, summary)
    text = markdown({"summary": summarize([_run("p", "0", 100, 10.0)], COSTS, 0.0), "modes": {},
                     "costs": {"draft_step": 0.3, "verify": list(COSTS.verify)},
                     "weights_per_token": {"target": target}})
    assert "the target's int8 form 1,000.0 MiB, at 10.00 tok/s 10.5 GB/s (target only)." in text
