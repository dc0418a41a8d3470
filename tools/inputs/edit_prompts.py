"""Write an edit-task bench prompt set (stdlib functions under rewrite instructions), after another set.

    python tools/inputs/edit_prompts.py OUT.json [--after SET.json]
    specdec bench BUNDLE --prompts OUT.json --draft-tokens 0,auto --proposers lookup,suffix

``--after SET.json`` writes SET's prompts first (e.g. the public prompt set), then the edit prompts: one
bench run then covers code, prose and edits side by side.
"""

import argparse
import json
import sys
from pathlib import Path

from specdec.bench.bench import load_prompts
from specdec.bench.prompt_sets import edit_prompts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("out", type=Path)
parser.add_argument("--after", metavar="SET.json", help="a prompt set to write first (checked as the bench checks it)")
args = parser.parse_args()
try:
    first = load_prompts(args.after, None) if args.after else []
except ValueError as exc:
    sys.exit(f"edit_prompts: error: {exc}")
prompts = first + edit_prompts()
args.out.write_text(json.dumps(prompts, indent=1))
print(f"wrote {len(prompts)} prompts to {args.out}")
