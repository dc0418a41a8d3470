"""Write the session-bench traces (chat over a pasted file, editor FIM typing, long completions, edits).

    python tools/inputs/make_traces.py OUT_DIR
    specdec bench BUNDLE --session OUT_DIR/*.json [--peer-llama-server BIN --peer-gguf TARGET.gguf]

The traces are built from this Python's standard library (``inspect.getsource``), so nothing of it is
stored in the repository; the same Python version writes the same files.
"""

import argparse
import sys

from specdec.bench.traces import make_traces, python_version, write_traces

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("out_dir")
args = parser.parse_args()
try:
    written = write_traces(args.out_dir)
except OSError as exc:
    sys.exit(f"make_traces: cannot write to {args.out_dir}: {exc.strerror or exc}")
for path, trace in zip(written, make_traces().values()):
    print(f"{path}: {len(trace['requests'])} requests ({trace['description']})")
print(f"from Python {python_version()}'s standard library")
