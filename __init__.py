"""specdec: speculative decoding with an exported ONNX bundle and a lean onnxruntime runtime.

``from specdec import SpeculativeDecoder, SamplingConfig`` needs only numpy, onnxruntime
and tokenizers. The exporter (``specdec.export``) needs the ``[export]`` extra.
"""

from specdec.runtime.decoder import GenerationResult, GenerationStats, SpeculativeDecoder
from specdec.runtime.sampling import SamplingConfig
import specdec.engines  # noqa: E402,F401  registers the native TensorRT backend (imports nothing GPU-side)

__all__ = ["SpeculativeDecoder", "SamplingConfig", "GenerationResult", "GenerationStats"]
__version__ = "0.1.0"
