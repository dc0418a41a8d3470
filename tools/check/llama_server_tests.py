"""llama-server's own server tests (llama.cpp's tools/server/tests) against `specdec serve` and against llama-server,
side by side: the tests a client of llama-server relies on, run as its maintainers run them.

The suite is not copied into this project: it is read from the llama-cpp-python source distribution (the same one
../shared/build-llama-server.sh builds llama.cpp from), downloaded from the package registry unless --llama-src names
an unpacked one. Each test starts its server through ``LLAMA_SERVER_BIN_PATH``; here that is a small launcher that
starts either `specdec serve BUNDLE` (llama-server's flags mapped onto specdec's, model-source flags dropped) or
llama-server on one GGUF (the suite's model-source flags swapped for ``-m GGUF``). The suite's own model downloads
(``ServerPreset.load_all``) are switched off: nothing is fetched from a model hub.

    python tools/check/llama_server_tests.py --bundle BUNDLE [--llama-server BIN --gguf FILE] [--files test_tokenize.py ...]
        [--llama-src DIR] [--out DIR] [-k EXPR]

Prints both pass lists and their difference, and writes ``results.json`` (test id -> outcome per server) to --out.
Needs the suite's requirements (``pip install requests wget openai aiohttp prometheus-client filelock``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's sdist, as ../shared/build-llama-server.sh
DEFAULT_FILES = ("test_tokenize.py", "test_infill.py", "test_chat_completion.py", "test_compat_anthropic.py",
                 "test_compat_oai_responses.py", "test_basic.py", "test_completion.py", "test_security.py")
# llama-server's flags that take no value (every other --flag the suite passes takes one)
SWITCHES = {"--offline", "--cont-batching", "--embedding", "--reranking", "--metrics", "--kv-unified", "--swa-full",
            "--slots", "--no-slots", "--verbose", "--context-shift", "--no-ui", "--no-models-autoload", "--jinja",
            "--no-jinja", "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling"}
MODEL_SOURCE = {"--hf-repo", "--hf-file", "--model", "-m", "--model-url", "--offline", "--models-dir",
                "--models-max", "--models-preset", "--model-draft", "--mmproj-url", "--no-mmproj"}
# llama-server's flag -> specdec serve's (the rest have no meaning to specdec and are dropped)
TO_SPECDEC = {"--host": "--host", "--port": "--port", "--alias": "--model-name", "--ctx-size": "--ctx-size",
              "--parallel": "--workers", "--slot-save-path": "--slot-save-path", "--api-key": "--api-key",
              "--threads": "--threads", "--no-ui": "--no-webui", "--cors-origins": "--cors-origins",
              "--seed": "--seed", "--slots": "--slots", "--no-slots": "--no-slots",
              "--chat-template-file": "--chat-template-file", "--verbose": "--verbose"}

LAUNCHER = '''#!{python}
import os, sys
args, out, i = sys.argv[1:], [], 0
target = os.environ["SUITE_TARGET"]
switches, dropped, mapping = {switches!r}, {dropped!r}, {mapping!r}
while i < len(args):
    flag = args[i]
    value = None if flag in switches or i + 1 >= len(args) else args[i + 1]
    i += 1 if value is None else 2
    if target == "llama":
        if flag not in dropped:
            out += [flag] + ([] if value is None else [value])
    elif flag in mapping:
        out += [mapping[flag]] + ([] if value is None else [value])
if target == "llama":
    os.execv(os.environ["SUITE_LLAMA_SERVER"], [os.environ["SUITE_LLAMA_SERVER"], "-m", os.environ["SUITE_GGUF"], *out])
os.execv(sys.executable, [sys.executable, "-m", "specdec.cli.main", "serve", os.environ["SUITE_BUNDLE"], *out])
'''

PLUGIN = '''
def pytest_sessionstart(session):
    import utils  # the suite's own: its model presets would download from a model hub
    utils.ServerPreset.load_all = staticmethod(lambda: None)
'''


def suite_dir(llama_src: str | None, work: Path) -> Path:
    """The suite's folder: in --llama-src, else in the sdist downloaded into ``work``."""
    if llama_src is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"llama-cpp-python=={VERSION}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(work)], check=True)
        subprocess.run(["tar", "xzf", str(work / f"llama_cpp_python-{VERSION}.tar.gz"), "-C", str(work)], check=True)
        llama_src = str(work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp")
    tests = Path(llama_src) / "tools" / "server" / "tests"
    if not (tests / "utils.py").is_file():
        raise SystemExit(f"no llama-server tests in {tests}")
    return tests


def run_suite(tests: Path, target: str, env: dict, files, work: Path, keyword: str | None) -> dict:
    """{test id: "passed" | "failed" | "skipped"} of one run of ``files`` against ``target``."""
    launcher = work / "launcher.py"
    launcher.write_text(LAUNCHER.format(python=sys.executable, switches=SWITCHES, dropped=MODEL_SOURCE,
                                        mapping=TO_SPECDEC))
    launcher.chmod(0o755)
    (work / "suite_offline.py").write_text(PLUGIN)
    report = work / f"{target}.xml"
    run_env = {**os.environ, **env, "SUITE_TARGET": target, "LLAMA_SERVER_BIN_PATH": str(launcher),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(work), str(tests), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", "-p", "suite_offline", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *[f"unit/{name}" for name in files]] + (["-k", keyword] if keyword else [])
    subprocess.run(command, cwd=tests, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return outcomes_of(report)


def outcomes_of(report: Path) -> dict:
    """{test id: outcome} from a pytest JUnit XML report."""
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    return outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", required=True, help="the specdec bundle to serve")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (with --gguf: run it too)")
    parser.add_argument("--gguf", default=None, help="the GGUF llama-server serves (the bundle's target's source)")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="the suite's unit/ files to run")
    parser.add_argument("--llama-src", default=None, help="an unpacked llama.cpp tree (default: the sdist's)")
    parser.add_argument("--out", default=None, help="folder for results.json (default: none kept, the table is printed)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--servers", default="specdec,llama",
                        help="which to run now (specdec, llama); results already in --out's results.json are kept")
    args = parser.parse_args(argv)
    if (args.llama_server is None) != (args.gguf is None):
        parser.error("--llama-server and --gguf go together")
    with tempfile.TemporaryDirectory(prefix="llama-server-tests-") as folder:  # the sdist, launcher, reports: removed
        return run(args, Path(folder))


def run(args, work: Path) -> int:
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    tests = suite_dir(args.llama_src, work)
    args.files = [name if name.endswith(".py") else f"{name}.py" for name in args.files]  # test_x or test_x.py
    missing = [name for name in args.files if not (tests / "unit" / name).is_file()]
    if missing:
        raise SystemExit(f"--files: no such file in the suite's unit/: {', '.join(missing)}")
    wanted = {name.strip() for name in args.servers.split(",")}
    saved = out / "results.json"
    runs = json.loads(saved.read_text()) if saved.is_file() else {}
    if "specdec" in wanted:
        runs["specdec"] = run_suite(tests, "specdec", {"SUITE_BUNDLE": str(Path(args.bundle).resolve())}, args.files,
                                    work, args.keyword)
    if args.llama_server and "llama" in wanted:
        runs["llama"] = run_suite(tests, "llama", {"SUITE_LLAMA_SERVER": str(Path(args.llama_server).resolve()),
                                                   "SUITE_GGUF": str(Path(args.gguf).resolve())},
                                  args.files, work, args.keyword)
    runs = {name: runs[name] for name in ("specdec", "llama") if name in runs}
    names = sorted(set().union(*runs.values()))
    print(f"{'test':<90} " + " ".join(f"{name:>8}" for name in runs))
    for name in names:
        print(f"{name[:90]:<90} " + " ".join(f"{runs[run].get(name, '-'):>8}" for run in runs))
    for run, outcomes in runs.items():
        print(f"{run}: {sum(v == 'passed' for v in outcomes.values())} passed of {len(outcomes)}")
    if "llama" in runs and "specdec" in runs:
        missing = [n for n in names if runs["llama"].get(n) == "passed" and runs["specdec"].get(n) != "passed"]
        print(f"passed against llama-server, not against specdec: {len(missing)}")
        for name in missing:
            print(f"  {name}")
    saved.write_text(json.dumps(runs, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
