"""Weight-only quantization with onnxruntime's own tools (MatMulNBits, block-wise).

int4 and int8 both become ``com.microsoft.MatMulNBits`` (bits=4 or 8), symmetric,
block size 32, on every MatMul whose weight is a constant (projections, MLP, lm_head).
Activations, the KV cache and attention stay in the model dtype.
"""

from __future__ import annotations

from pathlib import Path

QUANTS = ("none", "int4", "int8")
BLOCK_SIZE = 32


def quantize_onnx(src: Path, dst: Path, quant: str, accuracy_level: int | None = None) -> None:
    """Quantize the model at ``src`` (ONNX + external data) into ``dst``."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if quant not in ("int4", "int8"):
        raise ValueError(f"quant {quant!r} is not one of int4, int8")
    bits = 4 if quant == "int4" else 8
    model = onnx.load(str(src), load_external_data=True)
    config = DefaultWeightOnlyQuantConfig(
        block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=accuracy_level, bits=bits
    )
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=accuracy_level, algo_config=config
    )
    quantizer.process()
    del model
    dst.parent.mkdir(parents=True, exist_ok=True)
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)
