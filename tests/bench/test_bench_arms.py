"""The shuffled A/B harness (bench/arms.py): arms as data, settings applied per run and restored."""

import pytest

from specdec.bench.arms import arms_markdown, parse_arms, run_arms, summarize_arms
from specdec.decoding.proposers import draft as proposers


def test_arms_are_checked_and_name_what_is_wrong():
    with pytest.raises(ValueError, match="at least two arms"):
        parse_arms({"only": {}})
    with pytest.raises(ValueError, match="'b' must be an object"):
        parse_arms({"a": {}, "b": {"option": {}}})
    arms = parse_arms({"a": {"options": {"num_draft_tokens": 0}}, "b": {"settings": {"probe_budget.share": None}}})
    assert [arm.name for arm in arms] == ["a", "b"] and arms[0].options == {"num_draft_tokens": 0}


def test_each_run_gets_its_arms_settings_and_all_are_restored(tiny_decoder, monkeypatch):
    """Each arm's runs see its own settings (and the other arms' put back); afterwards everything is as before.
    The outputs of a setting that changes only speed are the baseline's, and the summary counts them."""
    seen = []
    original_generate = tiny_decoder.generate

    def spy(*args, **kwargs):
        seen.append((kwargs.get("num_draft_tokens", "auto"), tiny_decoder.probe_budget.share,
                     proposers.DRAFT_MAX_PROBE_EVERY))
        return original_generate(*args, **kwargs)

    arms = parse_arms({
        "target": {"options": {"num_draft_tokens": 0}},
        "steady": {"settings": {"specdec.decoding.proposers.draft:DRAFT_MAX_PROBE_EVERY": 16}},
        "unbudgeted": {"settings": {"probe_budget.share": None}},
    })
    share, wait = tiny_decoder.probe_budget.share, proposers.DRAFT_MAX_PROBE_EVERY
    prompts = [{"id": "a", "kind": "code", "prompt": "def add(a, b):\n    return"},
               {"id": "b", "kind": "prose", "prompt": "The sky is"}]
    monkeypatch.setattr(tiny_decoder, "generate", spy)
    rows = run_arms(tiny_decoder, prompts, arms, repeats=2, max_new_tokens=6)
    monkeypatch.undo()
    assert len(rows) == 12 and len(seen) == 12
    orders = {tuple(row["arm"] for row in rows[start : start + 3]) for start in range(0, 12, 3)}
    assert len(orders) > 1  # the arms' order is shuffled per prompt, not fixed
    assert seen.count((0, share, wait)) == 4
    assert seen.count(("auto", share, 16)) == 4
    assert seen.count(("auto", None, wait)) == 4
    assert (tiny_decoder.probe_budget.share, proposers.DRAFT_MAX_PROBE_EVERY) == (share, wait)
    summary = summarize_arms(rows, "target")
    assert set(summary) == {"all", "code", "prose"}
    assert summary["all"]["target"]["summed_ratio"] == pytest.approx(1.0)
    assert summary["code"]["steady"]["pairs"] == 2
    assert summary["all"]["unbudgeted"]["same_output"] == 4  # greedy, exact rows on the tiny model
    assert summary["all"]["target"]["end_to_end_ratio"] == pytest.approx(1.0)
    assert "| prose | steady | 2 |" in arms_markdown(summary, "target")


def test_end_to_end_counts_prefill_and_older_rows_without_it_print_a_dash():
    rows = [{"repeat": 0, "id": "a", "kind": "code", "arm": arm, "tokens": 10, "seconds": decode,
             "prefill_seconds": prefill, "draft_seconds": 0.0, "draft_forwards": 0, "ids": [1]}
            for arm, decode, prefill in (("target", 2.0, 1.0), ("eager", 1.0, 2.0), ("lazy", 1.5, 1.0))]
    summary = summarize_arms(rows, "target")["code"]
    assert summary["eager"]["summed_ratio"] == pytest.approx(2.0)  # decode only: the eager arm looks best
    assert summary["eager"]["end_to_end_ratio"] == pytest.approx(1.0)  # its prefill took back what it saved
    assert summary["lazy"]["end_to_end_ratio"] == pytest.approx(3.0 / 2.5)
    for row in rows:
        del row["prefill_seconds"]
    summary = summarize_arms(rows, "target")
    assert summary["code"]["lazy"]["end_to_end_ratio"] is None
    assert "| code | lazy | 1 | 1.333 | 1.333 | - |" in arms_markdown(summary, "target")


def test_a_setting_that_names_nothing_is_refused(tiny_decoder):
    arms = parse_arms({"a": {}, "b": {"settings": {"probe_budget.nothing": 1}}})
    with pytest.raises(ValueError, match="names nothing"):
        run_arms(tiny_decoder, [{"id": "a", "prompt": "x"}], arms)
