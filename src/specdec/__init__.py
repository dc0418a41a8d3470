"""specdec: speculative decoding with an exported ONNX bundle and a lean onnxruntime runtime.

``from specdec import SpeculativeDecoder, SamplingConfig`` needs only numpy, onnxruntime
and tokenizers. The exporter (``specdec.export``) needs the ``[export]`` extra.

Packages, lowest layer first (each imports only packages listed before it; ``tests/test_layers.py``):
``contract`` (what export writes and the runtime trusts), ``sampling`` (pure numpy), ``runners``
(a model pass into a preallocated KV cache), ``decoding`` (the speculative loop), ``export``,
``serving``, ``bench``, ``cli``.
"""

from specdec.contract.manifest import BundleError
from specdec.decoding.text.chat import ChatTemplateError
from specdec.decoding.constraint import Constraint, ConstraintError, TokenLogprob
from specdec.decoding.decoder import GenerationResult, GenerationStats, SpeculativeDecoder
from specdec.decoding.options import ContextLengthError, GenerationError, GenerationOptions
from specdec.decoding.request import PrefillProgress
from specdec.runners.memory import MemoryBudgetError
from specdec.sampling.processors import DistributionError, SamplingConfig

__all__ = ["SpeculativeDecoder", "GenerationOptions", "SamplingConfig", "GenerationResult", "GenerationStats",
           "GenerationError", "ContextLengthError", "DistributionError", "BundleError", "ChatTemplateError",
           "MemoryBudgetError", "Constraint", "ConstraintError", "TokenLogprob", "PrefillProgress"]
__version__ = "0.2.0"
