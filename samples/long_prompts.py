"""Write a long-context bench prompt set (~1,500-token prompts cut from the Python standard library).

    python samples/long_prompts.py BUNDLE OUT.json [TOKENS] [--after SET.json]
    specdec bench BUNDLE --prompts OUT.json --draft-tokens 0,1,2,auto

``--after SET.json`` writes SET's prompts first, then the long ones: one bench run (one process, one
load order) then times short and long contexts side by side.

The prompts are cut with BUNDLE's tokenizer, so they are TOKENS long for that model.
"""

import json
import sys
from pathlib import Path

from specdec.runtime.manifest import Manifest
from specdec.runtime.prompt_sets import LONG_CONTEXT_TOKENS, long_context_prompts
from specdec.runtime.text import TextCodec

args = sys.argv[1:]
first = []
if "--after" in args:
    at = args.index("--after")
    if at + 1 >= len(args):
        sys.exit(__doc__)
    try:
        first = json.loads(Path(args[at + 1]).read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"long_prompts: error: --after {args[at + 1]}: {exc}")
    if not isinstance(first, list):
        sys.exit(f"long_prompts: error: --after {args[at + 1]} is not a JSON list of prompts")
    del args[at : at + 2]
if len(args) not in (2, 3):
    sys.exit(__doc__)
bundle, out = Path(args[0]), Path(args[1])
codec = TextCodec(bundle / Manifest.read(bundle).tokenizer_file)
prompts = first + long_context_prompts(codec.encode, codec.decode, int(args[2]) if len(args) == 3 else LONG_CONTEXT_TOKENS)
out.write_text(json.dumps(prompts, indent=1))
print(f"wrote {len(prompts)} prompts to {out}")
