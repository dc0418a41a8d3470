"""Speculative sampling is lossless: the first two tokens follow the target's exact distribution.

The reference is computed independently of the runtime: the Hugging Face model's logits and
transformers' own LogitsProcessors give the exact joint distribution of the first two
tokens. Thousands of speculative runs (draft deliberately different) are compared with a
chi-square test; the same test fails when the draft records the untruncated softmax
instead of the distribution it really sampled from.
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec import SamplingConfig, SpeculativeDecoder
from specdec.sampling.processors import sample

torch = pytest.importorskip("torch")

from test_processors import hf_distribution  # noqa: E402
from tiny_models import build_noisy_copy  # noqa: E402

CONFIG = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.3)
PROMPT = "def f(x):"
RUNS = 3000


@pytest.fixture(scope="module")
def different_pair(tiny_pair_dirs, tmp_path_factory):
    from specdec.export.bundle import ExportOptions, export_bundle

    target, _ = tiny_pair_dirs
    root = tmp_path_factory.mktemp("stat_pair")
    draft = build_noisy_copy(target, root / "draft", noise=0.03, seed=3)
    export_bundle(ExportOptions(target=str(target), draft=str(draft), out=root / "bundle", parity=False),
                  progress=lambda msg: None)
    return target, root / "bundle"


def exact_joint(target_dir, prompt_ids):
    """{(x1, x2): probability} from the Hugging Face model and transformers' processors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()

    def dist(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
        return hf_distribution(logits, ids, CONFIG)

    joint = {}
    first = dist(prompt_ids)
    for x1 in np.flatnonzero(first):
        second = dist(prompt_ids + [int(x1)])
        for x2 in np.flatnonzero(second):
            joint[(int(x1), int(x2))] = first[x1] * second[x2]
    return joint


def sampled_pvalue(decoder, joint, prompt=PROMPT, proposer="draft", tree=None, acceptance="rejection"):
    counts = {}
    for seed in range(RUNS):
        ids = decoder.generate(prompt, max_new_tokens=3, sampling=CONFIG, num_draft_tokens=2, seed=seed,
                               proposer=proposer, tree=tree, acceptance=acceptance).token_ids
        counts[tuple(ids[:2])] = counts.get(tuple(ids[:2]), 0) + 1
    assert set(counts) <= set(joint), "a sampled pair has zero target probability"
    keys = sorted(joint, key=joint.get, reverse=True)
    big = [k for k in keys if joint[k] * RUNS >= 5]
    expected = [joint[k] * RUNS for k in big] + [RUNS * (1 - sum(joint[k] for k in big))]
    observed = [counts.get(k, 0) for k in big] + [RUNS - sum(counts.get(k, 0) for k in big)]
    if expected[-1] < 1e-9:
        expected, observed = expected[:-1], observed[:-1]
    return chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue


# lookup needs a prompt whose suffix repeats: "(x):" recurs, so a proposal is made from the first round on
@pytest.mark.parametrize("proposer, prompt, acceptance", [
    ("draft", PROMPT, "rejection"), ("draft", PROMPT, "coupled"), ("lookup", "f(x): g(x): h(x):", "rejection"),
    ("hybrid", "f(x): g(x): h(x):", "rejection")])
def test_speculative_sampling_matches_exact_target_distribution(different_pair, proposer, prompt, acceptance):
    target_dir, bundle = different_pair
    decoder = SpeculativeDecoder.load(bundle)
    joint = exact_joint(target_dir, decoder.codec.encode(prompt))
    assert 3 <= len(joint) and abs(sum(joint.values()) - 1) < 1e-6
    runs = [decoder.generate(prompt, max_new_tokens=64, sampling=CONFIG, num_draft_tokens=2, seed=seed,
                             proposer=proposer, acceptance=acceptance).stats for seed in range(3)]
    rate = sum(s.accepted for s in runs) / max(sum(s.proposed for s in runs), 1)
    assert 0.05 < rate < 0.95  # both acceptance and rejection are exercised (a seed may end early at EOS)
    if proposer != "draft":
        assert sum(s.lookup_rounds + s.suffix_rounds for s in runs) > 0  # the deterministic proposer ran
    assert sampled_pvalue(decoder, joint, prompt, proposer, acceptance=acceptance) > 1e-3


def test_recording_the_untruncated_softmax_is_caught(different_pair, monkeypatch):
    target_dir, bundle = different_pair
    decoder = SpeculativeDecoder.load(bundle)
    joint = exact_joint(target_dir, decoder.codec.encode(PROMPT))


    from specdec.decoding.rules import TokenRule

    def untruncated_record(self, logits, context, position, path=()):
        from specdec.sampling.processors import sampling_distribution

        dist = sampling_distribution(logits, context, self.config)
        token = sample(dist, self.rng)
        scaled = logits.astype(np.float64) / self.config.temperature
        softmax = np.exp(scaled - scaled.max())
        return token, softmax / softmax.sum()  # records what it did NOT sample from

    monkeypatch.setattr(TokenRule, "propose", untruncated_record)
    assert sampled_pvalue(decoder, joint) < 1e-4


@pytest.mark.parametrize("tree", ["3,2", "auto"])
def test_tree_sampling_matches_exact_target_distribution(different_pair, tree):
    target_dir, bundle = different_pair
    decoder = SpeculativeDecoder.load(bundle)
    joint = exact_joint(target_dir, decoder.codec.encode(PROMPT))
    assert sampled_pvalue(decoder, joint, tree=tree) > 1e-3


def test_wrong_sibling_correction_is_caught(different_pair, monkeypatch):
    """Siblings are drawn without replacement: keeping q unchanged after a rejection (the with-replacement rule) is biased."""
    from specdec.decoding import rules as rules_module
    from specdec.decoding.tree import tree_speculative_accept

    target_dir, bundle = different_pair
    decoder = SpeculativeDecoder.load(bundle)
    joint = exact_joint(target_dir, decoder.codec.encode(PROMPT))
    monkeypatch.setattr(rules_module, "tree_speculative_accept",
                        lambda tree, dist, rng: tree_speculative_accept(tree, dist, rng, without_replacement=False))
    assert sampled_pvalue(decoder, joint, tree="3,2") < 1e-4
