"""``stream(on_prefill=...)``: llama-server's prompt progress from the prefill itself (before the first chunk, after
each, once the prompt is read), a warm cache reported as reused, and the output unchanged by the reports."""

from __future__ import annotations

import pytest

from specdec import PrefillProgress


@pytest.fixture(scope="module")
def decoder(tiny_bundle):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder.load(tiny_bundle, max_context=512, verify=False)


def _reports(decoder, prompt, **options):
    reports = []
    stream = decoder.stream(prompt, on_prefill=reports.append, max_new_tokens=6, **options)
    text = "".join(stream)
    return reports, text, list(stream.token_ids)


def test_a_cold_prompt_reports_every_chunk_then_the_whole_prompt(decoder):
    decoder.clear_cache()
    prompt = [3 + i % 120 for i in range(150)]  # three 64-token chunks
    reports, _, _ = _reports(decoder, prompt)
    assert all(isinstance(report, PrefillProgress) for report in reports)
    assert reports[0].cached == reports[0].processed == 0 and reports[0].total == len(prompt)
    assert [report.processed for report in reports] == [0, 64, 128, 150]  # the last chunk leaves two: read
    assert all(report.total == len(prompt) and report.cached == 0 for report in reports)
    assert all(a.seconds <= b.seconds for a, b in zip(reports, reports[1:]))


def test_a_warm_prompt_reports_what_was_reused(decoder):
    decoder.clear_cache()
    prompt = list(range(3, 3 + 90))
    _reports(decoder, prompt)
    reports, _, _ = _reports(decoder, prompt)
    assert reports[0].cached == reports[0].processed == len(prompt) - 1  # all but the last token reused
    assert reports[-1].processed == reports[-1].total == len(prompt) and len(reports) == 2


def test_reports_change_no_token(decoder):
    prompt = list(range(5, 5 + 70))
    decoder.clear_cache()
    plain = decoder.generate(prompt, max_new_tokens=6).token_ids
    decoder.clear_cache()
    _, _, reported = _reports(decoder, prompt)
    assert reported == plain


def test_a_report_target_that_is_not_callable_is_refused(decoder):
    with pytest.raises(ValueError, match="on_prefill"):
        decoder.stream([3, 4, 5], on_prefill="print", max_new_tokens=2)
