"""``specdec``: the runtime's commands (``specdec.runtime.cli``) plus ``demo``, which may export the default pair.

``demo`` needs the exporter, so it is composed here, above both halves: the runtime never imports
``specdec.export``.
"""

from __future__ import annotations

import sys

from specdec.demo import add_demo_parser, cmd_demo
from specdec.runtime.cli import main as runtime_main


def main(argv=None) -> int:
    return runtime_main(argv, extensions=(("demo", add_demo_parser, cmd_demo),))


if __name__ == "__main__":
    sys.exit(main())
