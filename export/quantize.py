"""Weight-only quantization with onnxruntime's own tools (MatMulNBits, block-wise).

int4 and int8 both become ``com.microsoft.MatMulNBits`` (bits=4 or 8), symmetric,
block size 32, on every MatMul whose weight is a constant (projections, MLP, lm_head).
Activations, the KV cache and attention stay in the model dtype.
"""

from __future__ import annotations

from pathlib import Path

QUANTS = ("none", "int4", "int8")
BLOCK_SIZE = 32


def quantize_onnx(src: Path, dst: Path, quant: str, accuracy_level: int | None = None, isolated: bool = True) -> None:
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
        proc = subprocess.run([sys.executable, "-m", "specdec.export.quantize", str(src), str(dst), quant, level],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"quantization of {src.name} failed: {tail}")
        return
    _quantize(src, dst, quant, accuracy_level)


def release_freed_memory() -> None:
    """Give memory freed by Python/PyTorch back to the OS (glibc malloc_trim), where available."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _quantize(src: Path, dst: Path, quant: str, accuracy_level: int | None) -> None:
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


if __name__ == "__main__":  # the isolated worker of quantize_onnx
    import sys

    _src, _dst, _quant, _level = sys.argv[1:5]
    _quantize(Path(_src), Path(_dst), _quant, None if _level == "none" else int(_level))
