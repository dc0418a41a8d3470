"""A proposer is one module: a new file in ``decoding/proposers`` that defines ``PROPOSER`` is a choice of the API
(and of every list built from the registry), with nothing else edited. Shown with a module written to a temporary
folder added to the package's search path; greedy output stays target-only's whatever it proposes."""

import pytest
from package_extension import package_with

import specdec.decoding.proposers as proposers
from specdec import GenerationError

MODULE = '''
from specdec.decoding.proposers.base import Proposer, ProposerEntry, chain


class RepeatLast(Proposer):
    """Proposes the last token again, a few times (a poor proposer: verification must still keep the output)."""
    name = "repeat"

    def __init__(self, request, resources):
        self.count = 3 if request.auto else request.num_draft_tokens

    def propose(self, round):
        tokens = round.state.tokens
        return chain("repeat", [tokens[-1]] * self.count) if tokens else None


PROPOSER = ProposerEntry("repeat", RepeatLast, "the last token again (a test proposer)", rank=50)
'''


@pytest.fixture
def with_new_module(tmp_path, monkeypatch):
    with package_with(monkeypatch, proposers, proposers.proposer_entries, tmp_path, {"repeat_last.py": MODULE}):
        yield


def test_a_new_module_is_a_proposer_with_target_only_output(with_new_module):
    from scripted import scripted_decoder

    assert "repeat" in proposers.proposer_names()
    prompt = [3, 4, 4, 4, 5, 6, 6, 6, 6]
    dec = scripted_decoder()
    expected = dec.generate(prompt, max_new_tokens=40, num_draft_tokens=0).token_ids
    for mode in ({"num_draft_tokens": 2}, {}):
        result = dec.generate(prompt, max_new_tokens=40, proposer="repeat", **mode)
        assert result.token_ids == expected
        assert result.stats.proposed > 0


def test_without_the_module_the_name_is_a_one_line_error():
    from scripted import scripted_decoder

    proposers.proposer_entries.cache_clear()
    with pytest.raises(GenerationError, match="proposer"):
        scripted_decoder().generate([3, 4], max_new_tokens=4, proposer="repeat")


def test_defaults_and_tree_support_are_the_registry_s(tmp_path, monkeypatch):
    """Which proposer a request without ``proposer=`` gets, which one verifies ``tree=`` and which one may free the
    draft before the prefill are rows of the registry: a module that declares itself the default becomes it."""
    from scripted import scripted_decoder

    assert proposers.default_proposer(True, None) == "hybrid"
    assert proposers.default_proposer(False, None) == "suffix"
    assert proposers.default_proposer(True, [2, 1]) == "draft"
    default = MODULE.replace('rank=50)', 'rank=-1, default_with_draft=True, default_without_draft=True)')
    with package_with(monkeypatch, proposers, proposers.proposer_entries, tmp_path, {"repeat_default.py": default}):
        assert proposers.default_proposer(True, None) == proposers.default_proposer(False, None) == "repeat"
        result = scripted_decoder().generate([3, 4, 4, 4, 5], max_new_tokens=12, num_draft_tokens=2)
        assert set(result.stats.rounds_by_source) == {"repeat"}
        with pytest.raises(GenerationError, match='proposer="draft"'):
            scripted_decoder().generate([3, 4], max_new_tokens=4, proposer="repeat", tree=[2, 1])


def test_the_decoder_and_the_options_name_no_proposer():
    """The decoder asks the registry (``draft_cannot_pay``, ``accepts_tree``, the defaults) instead of naming
    proposers; a name in these files would couple them again."""
    import re
    from pathlib import Path

    import specdec.decoding.decoder as decoder
    import specdec.decoding.options as options

    for module in (decoder, options):
        code = "\n".join(line for line in Path(module.__file__).read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may name them
        named = re.findall(r'["\'](hybrid|suffix|lookup)["\']|proposer\s*==', code)
        assert not named, (module.__name__, named)
