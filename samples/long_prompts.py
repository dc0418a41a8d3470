"""Write a long-context bench prompt set (~1,500-token prompts cut from the Python standard library).

    python samples/long_prompts.py BUNDLE OUT.json [TOKENS]
    specdec bench BUNDLE --prompts OUT.json --draft-tokens 0,1,2,auto

The prompts are cut with BUNDLE's tokenizer, so they are TOKENS long for that model.
"""

import json
import sys
from pathlib import Path

from specdec.runtime.manifest import Manifest
from specdec.runtime.prompt_sets import LONG_CONTEXT_TOKENS, long_context_prompts
from specdec.runtime.text import TextCodec

if len(sys.argv) not in (3, 4):
    sys.exit(__doc__)
bundle, out = Path(sys.argv[1]), Path(sys.argv[2])
codec = TextCodec(bundle / Manifest.read(bundle).tokenizer_file)
prompts = long_context_prompts(codec.encode, codec.decode, int(sys.argv[3]) if len(sys.argv) == 4 else LONG_CONTEXT_TOKENS)
out.write_text(json.dumps(prompts, indent=1))
print(f"wrote {len(prompts)} prompts to {out}")
