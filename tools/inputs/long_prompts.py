"""Write a long-context bench prompt set (~1,500-token prompts cut from the Python standard library).

    python tools/inputs/long_prompts.py BUNDLE OUT.json [TOKENS] [--after SET.json]
    specdec bench BUNDLE --prompts OUT.json --draft-tokens 0,1,2,auto

``--after SET.json`` writes SET's prompts first, then the long ones: one bench run (one process, one
load order) then times short and long contexts side by side.

The prompts are cut with BUNDLE's tokenizer, so they are TOKENS long for that model.
"""

import argparse
import json
import sys
from pathlib import Path

from specdec.bench.bench import load_prompts
from specdec.contract.manifest import Manifest
from specdec.bench.prompt_sets import LONG_CONTEXT_TOKENS, long_context_prompts
from specdec.decoding.text.codec import TextCodec

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("bundle", type=Path)
parser.add_argument("out", type=Path)
parser.add_argument("tokens", type=int, nargs="?", default=LONG_CONTEXT_TOKENS)
parser.add_argument("--after", metavar="SET.json", help="a prompt set to write first (checked as the bench checks it)")
args = parser.parse_args()
try:
    first = load_prompts(args.after, None) if args.after else []
except ValueError as exc:
    sys.exit(f"long_prompts: error: {exc}")
codec = TextCodec(args.bundle / Manifest.read(args.bundle).tokenizer_file)
prompts = first + long_context_prompts(codec.encode, codec.decode, args.tokens)
args.out.write_text(json.dumps(prompts, indent=1))
print(f"wrote {len(prompts)} prompts to {args.out}")
