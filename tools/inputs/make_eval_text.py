"""Write the held-out text of ``specdec eval`` (``specdec.bench.eval_text``): the same as ``specdec eval
--write-text OUT.txt``, kept for the commands results folders record.

    python tools/inputs/make_eval_text.py OUT.txt
    specdec eval BUNDLE --text OUT.txt          # or with no --text: the same text, built in
    llama-perplexity -m TARGET.gguf -f OUT.txt -c 512
"""

import argparse
import sys
from pathlib import Path

from specdec.bench.eval_text import describe, eval_text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    text = eval_text()
    args.out.write_bytes(text.encode("utf-8"))
    print(f"wrote {args.out}: {describe(text)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
