"""Weight-only quantization with onnxruntime's own tools, block-wise and symmetric.

- ``int4`` / ``int8``: every MatMul whose weight is a constant (projections, MLP, lm_head)
  becomes ``com.microsoft.MatMulNBits`` (bits=4 or 8): onnxruntime's fastest CPU form.
- ``int4-qdq``: the same weights as standard ONNX ``DequantizeLinear`` (int4, blocked:
  ``block_size`` attribute, opset 21) feeding a plain ``MatMul``: the form TensorRT 10.x builds as int4
  weight-only quantization; onnxruntime runs it too (its CPU optimizer fuses DQ + MatMul back
  into MatMulNBits).
Activations, the KV cache and attention stay in the model dtype.
"""

from __future__ import annotations

from pathlib import Path

QUANTS = ("none", "int4", "int8", "int4-qdq")
BLOCK_SIZE = 32  # the target's default: the accuracy of onnxruntime-genai's CPU int4 models
# The draft's default. Its accuracy only moves the acceptance rate, never the output; measured on the
# Qwen2.5-Coder pair (12 public prompts, greedy g=2): block 128 makes a draft step 0.29x of a target
# step instead of 0.37x at the same acceptance (0.72), so every draft round is cheaper.
DRAFT_BLOCK_SIZE = 128
BLOCK_SIZES = (16, 32, 64, 128, 256)


def quantize_onnx(src: Path, dst: Path, quant: str, accuracy_level: int | None = None, isolated: bool = True,
                  block_size: int = BLOCK_SIZE) -> None:
    """Quantize the model at ``src`` (ONNX + external data) into ``dst``.

    ``isolated``: run in a fresh Python process. The quantizer holds the whole float model in
    memory; a fresh process does not add that to what the exporting process still holds (its
    allocator keeps freed PyTorch memory), which keeps the 1.5B export's peak lower.
    """
    if isolated:
        import subprocess
        import sys

        release_freed_memory()
        level = "none" if accuracy_level is None else str(accuracy_level)
        proc = subprocess.run([sys.executable, "-m", "specdec.export.quantize", str(src), str(dst), quant, level,
                               str(block_size)], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"quantization of {src.name} failed: {tail}")
        return
    _quantize(src, dst, quant, accuracy_level, block_size)


def release_freed_memory() -> None:
    """Give memory freed by Python/PyTorch back to the OS (glibc malloc_trim), where available."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _quantize(src: Path, dst: Path, quant: str, accuracy_level: int | None, block_size: int = BLOCK_SIZE) -> None:
    import onnx
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if quant not in QUANTS[1:]:
        raise ValueError(f"quant {quant!r} is not one of {', '.join(QUANTS[1:])}")
    bits = 8 if quant == "int8" else 4
    quant_format = QuantFormat.QDQ if quant == "int4-qdq" else QuantFormat.QOperator
    model = onnx.load(str(src), load_external_data=True)
    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level, bits=bits, quant_format=quant_format
    )
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level, algo_config=config
    )
    quantizer.process()
    del model
    dst.parent.mkdir(parents=True, exist_ok=True)
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


if __name__ == "__main__":  # the isolated worker of quantize_onnx
    import sys

    _src, _dst, _quant, _level, _block = sys.argv[1:6]
    _quantize(Path(_src), Path(_dst), _quant, None if _level == "none" else int(_level), int(_block))
