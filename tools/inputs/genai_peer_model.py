"""Build onnxruntime-genai's own int4 CPU model of the default pair's target, for ``specdec bench --peer-genai``.

    pip install -e ".[export,pair,peers]"
    python tools/inputs/genai_peer_model.py OUT_DIR [--role target|draft]

The pinned GGUF is loaded by transformers (dequantized to float32), saved as a Hugging Face
folder (genai's model builder reads safetensors), then built with genai's model builder:
int4, CPU (block 32, accuracy_level 4: the same MatMulNBits settings as a specdec int4 target).
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    args = parser.parse_args()

    from specdec.export.pair import DEFAULT_PAIR, pair_sources
    from specdec.export.sources import load_model, load_tokenizer, resolve_source

    target, draft = pair_sources(DEFAULT_PAIR)
    source = resolve_source(str(target if args.role == "target" else draft))
    with tempfile.TemporaryDirectory() as work:
        hf = Path(work) / "hf"
        model = load_model(source, "float32")
        model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained otherwise (see models.md)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf)
        load_tokenizer(source).save_pretrained(hf)
        del model
        return subprocess.call([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                                "-o", args.out, "-p", "int4", "-e", "cpu", "-c", str(Path(work) / "cache")])


if __name__ == "__main__":
    sys.exit(main())
