"""Long runs: 10,000 tokens in one request, 1,000 requests in one process, and a decoder shared by threads."""

import threading

import pytest

from specdec import SpeculativeDecoder


@pytest.fixture(scope="module")
def long_decoder(tmp_path_factory):
    pytest.importorskip("torch")
    from specdec.export.bundle import ExportOptions, export_bundle
    from tiny_models import build_noisy_copy, build_tiny_model

    root = tmp_path_factory.mktemp("long")
    target = build_tiny_model(root / "target", "llama", seed=0, max_positions=16384)
    draft = build_noisy_copy(target, root / "draft", noise=0.005, seed=1)
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=root / "bundle", parity=False),
                  progress=lambda m: None)
    return SpeculativeDecoder.load(root / "bundle", max_context=10_200)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        import os

        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.integration
def test_ten_thousand_tokens_in_one_request(long_decoder):
    long_decoder.eos_ids = frozenset()  # run the full length
    result = long_decoder.generate("def f(x):", max_new_tokens=10_000, num_draft_tokens=4)
    assert len(result.token_ids) == 10_000
    prompt_len = len(long_decoder.codec.encode("def f(x):"))
    # the target holds every committed token but the last (pending) one: no drift over 10k tokens
    assert long_decoder.target.length == prompt_len + 10_000 - 1
    assert long_decoder.draft.length <= prompt_len + 10_000 - 1


RSS_GROWTH_BOUND = 16 * 1024 * 1024  # bytes over 950 requests, after warm-up


@pytest.mark.integration
def test_thousand_requests_without_memory_growth_or_length_drift(long_decoder):
    prompts = ["def f(x):", "class A:", "import os\n", "x = [1, 2, 3]"]
    for i in range(50):  # warm-up: allocator pools, caches of the tokenizer and onnxruntime
        long_decoder.generate(prompts[i % 4], max_new_tokens=12, num_draft_tokens=3, seed=i)
    before = _rss_bytes()
    for i in range(950):
        prompt = prompts[i % 4]
        result = long_decoder.generate(prompt, max_new_tokens=12, num_draft_tokens=1 + i % 4, seed=i)
        expected = len(long_decoder.codec.encode(prompt)) + len(result.token_ids) - 1
        if result.finish_reason == "length":
            assert long_decoder.target.length == expected
    assert _rss_bytes() - before < RSS_GROWTH_BOUND


@pytest.mark.integration
def test_concurrent_use_of_one_decoder_is_refused_clearly(long_decoder):
    errors, started = [], threading.Event()

    def long_job():
        try:
            stream = long_decoder.stream("def f(x):", max_new_tokens=3000, num_draft_tokens=2)
            next(stream)
            started.set()
            for _ in stream:
                pass
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
            started.set()

    worker = threading.Thread(target=long_job)
    worker.start()
    started.wait(60)
    with pytest.raises(RuntimeError, match="already generating in another thread"):
        long_decoder.generate("x", max_new_tokens=4)
    worker.join()
    assert not errors
    assert len(long_decoder.generate("x", max_new_tokens=4).token_ids) == 4  # usable again afterwards
