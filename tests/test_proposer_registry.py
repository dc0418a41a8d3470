"""A proposer is one module: a new file in ``decoding/proposers`` that defines ``PROPOSER`` is a choice of the API
(and of every list built from the registry), with nothing else edited. Shown with a module written to a temporary
folder added to the package's search path; greedy output stays target-only's whatever it proposes."""

import pytest

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
    (tmp_path / "repeat_last.py").write_text(MODULE)
    monkeypatch.setattr(proposers, "__path__", [*proposers.__path__, str(tmp_path)])
    proposers.proposer_entries.cache_clear()
    yield
    proposers.proposer_entries.cache_clear()


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
