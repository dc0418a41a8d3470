"""The chat page at ``/`` (serving/webui): shipped with the package, safe by construction, and tested in a real browser.

Fast tests read the files (package data, no markup from text, nothing from another origin) and the CLI's
``--no-webui``. The browser tests drive Debian's headless Chromium (/usr/bin/chromium, /usr/bin/chromedriver:
never a browser download) with selenium against ``specdec serve`` on the tiny chat bundle, loopback only: the chat
streams, its spans are coloured by the sources the API reports for the same greedy request, a reply carrying
markup stays text, and the page requests nothing outside its own origin. Each check is also run on a planted
failure (sources dropped by the server, a page that renders replies as HTML, a page without its CSP) and must
report it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from paths import ROOT, tool_module

ROOT = ROOT
WEBUI = ROOT / "src" / "specdec" / "serving" / "webui"
MODEL = "tiny-chat"
PAYLOAD = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b>bold</b>'


# ----------------------------------------------------------------------------- the files (fast)
def test_importlib_resources_finds_the_page_and_pyproject_ships_it():
    """The files load through importlib.resources (as from a wheel), and pyproject's package data covers each."""
    import fnmatch
    import tomllib
    from importlib import resources

    from specdec.serving.webui import PAGE_FILES, page_files

    folder = resources.files("specdec.serving.webui")
    assert all((folder / name).is_file() for name in PAGE_FILES)
    assert set(page_files()) == set(PAGE_FILES) and all(page_files().values())
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "specdec.serving.webui"]
    shipped = [p.name for p in WEBUI.iterdir() if p.is_file() and p.suffix != ".py"]
    assert sorted(shipped) == sorted(PAGE_FILES)
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in patterns) for name in shipped)


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["pyproject.toml", "planted: no package data"])
def test_a_wheel_carries_the_page(tmp_path, variant):
    """A wheel built from the sources holds every page file (setuptools' package data); without the package-data
    table it would not (the planted variant)."""
    import zipfile

    from specdec.serving.webui import PAGE_FILES

    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "README.md", source / "README.md")
    pyproject = (ROOT / "pyproject.toml").read_text()
    if variant.startswith("planted"):
        planted = re.sub(r'\[tool\.setuptools\.package-data\]\n(#.*\n)*"specdec\.serving\.webui" = \[.*\]\n', "",
                         pyproject)
        assert planted != pyproject
        pyproject = planted
    (source / "pyproject.toml").write_text(pyproject)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("specdec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    carried = {f"specdec/serving/webui/{name}" for name in PAGE_FILES} <= names
    assert carried == (variant == "pyproject.toml") and "specdec/serving/webui/__init__.py" in names


def test_a_missing_page_file_is_a_clear_error(tmp_path):
    from specdec.serving.webui import page_files

    (tmp_path / "index.html").write_text("<!doctype html>")
    with pytest.raises(ValueError, match="missing from .*: app.js, style.css, icon.svg"):
        page_files(tmp_path)


HTML_SINKS = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\s*\(|new Function|"
                        r"setAttribute\(\s*['\"]on|\.srcdoc")
FOREIGN = re.compile(r"(?:https?:|wss?:|ftp:)?//[A-Za-z0-9.\-\[\]]+|\burl\(\s*['\"]?(?!/)[a-z]+:")
XML_NAMESPACE = "http://www.w3.org/2000/svg"  # an identifier in the SVG, never fetched


def page_problems(files: dict) -> list:
    """What in the page's files could turn text into markup or reach another origin."""
    problems = []
    for name, data in files.items():
        text = data.decode("utf-8").replace(XML_NAMESPACE, "")
        if name.endswith(".js"):
            text_no_comments = re.sub(r"^\s*//.*$", "", text, flags=re.M)
            problems += [f"{name}: {m.group(0)!r} makes markup of text" for m in HTML_SINKS.finditer(text_no_comments)]
        if name.endswith(".html"):
            problems += [f"{name}: inline script" for m in re.finditer(r"<script(?![^>]*\bsrc=)[^>]*>", text)]
            problems += [f"{name}: inline {m.group(1)!r} attribute" for m in re.finditer(r"\s(on\w+|style)=", text)]
        problems += [f"{name}: {m.group(0)!r} names another origin" for m in FOREIGN.finditer(text)]
    return problems


def test_page_files_make_no_markup_and_name_no_other_origin():
    from specdec.serving.webui import page_files

    assert page_problems(page_files()) == []


@pytest.mark.parametrize("plant", ['body.innerHTML = reply.content;', '<script>alert(1)</script>',
                                   '<link href="https://cdn.example/x.css">', '@import url("http://fonts.x/a");',
                                   '<p style="color:red">', 'fetch("//other.host/track")'])
def test_planted_page_problems_are_caught(plant):
    from specdec.serving.webui import page_files

    files = page_files()
    name = "app.js" if plant.startswith(("body", "fetch")) else "style.css" if plant.startswith("@") else "index.html"
    files[name] = files[name] + plant.encode()
    assert page_problems(files)


def test_no_webui_reaches_the_server_options(monkeypatch):
    """``specdec serve --no-webui`` builds the app with ``webui=False`` (and without it, True)."""
    pytest.importorskip("uvicorn")
    import uvicorn

    from specdec.cli.main import main
    from specdec.serving import app as app_module

    from specdec.decoding import load_options

    seen = []
    monkeypatch.setattr(app_module, "create_app", lambda pool, server: seen.append(server) or object())
    monkeypatch.setattr(app_module, "attach_loaded", lambda *args: None)
    monkeypatch.setattr(load_options, "BackgroundLoad", lambda *args, **kwargs: None)  # no bundle is read
    monkeypatch.setattr(uvicorn.Server, "run", lambda *args, **kwargs: None)
    assert main(["serve", "some-bundle", "--no-webui"]) == 0
    assert main(["serve", "some-bundle"]) == 0
    assert [options.webui for options in seen] == [False, True]


# ----------------------------------------------------------------------------- in a browser
def _tool():
    return tool_module("check/webui_screenshot.py")


@pytest.fixture(scope="module")
def tool():
    module = _tool()
    for path in (module.CHROMIUM, module.CHROMEDRIVER):
        if not os.path.exists(path):
            pytest.skip(f"{path} is missing (Debian: apt-get install chromium chromium-driver; .ci/run does)")
    pytest.importorskip("selenium")
    pytest.importorskip("uvicorn")
    return module


@pytest.fixture(scope="module")
def browser(tool, tmp_path_factory):
    driver = tool.chromium(str(tmp_path_factory.mktemp("chromium-profile")))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def served(chat_bundle, tool):
    """`specdec serve` on the tiny chat bundle, 127.0.0.1, one worker: (url, process)."""
    from test_server import _specdec_serve

    with _specdec_serve(chat_bundle, "--model-name", MODEL, "--shutdown-grace", "2") as served:
        yield served


@pytest.fixture(scope="module")
def decoder(chat_bundle):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder.load(chat_bundle)


@contextlib.contextmanager
def in_process_server(decoder, delay: float = 0.0, **server_options):
    """The same app over a fork of ``decoder`` in this process (a test may patch it; ``delay``: seconds after each
    piece): yields its url."""
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions
    from served_app import served_app as _uvicorn
    from test_server import SlowDecoder

    worker = SlowDecoder(decoder.fork(), delay) if delay else decoder.fork()
    pool = DecoderPool(worker, PoolOptions(workers=1, max_queue=2))
    with _uvicorn(create_app(pool, ServerOptions(model_name=MODEL, shutdown_grace=1.0, **server_options))) as (url, _):
        yield url


SETTINGS = {"proposer": "draft", "draft-tokens": "4", "max-tokens": "40", "temperature": "0"}
QUESTION = "def add(a, b):"


def api_answer(url: str) -> dict:
    """The same greedy request the page sends, through the API: {"content", "spans", "specdec", "usage"}."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 40, "temperature": 0,
            "proposer": "draft", "num_draft_tokens": 4, "token_sources": True}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    return {"content": answer["choices"][0]["message"]["content"], "specdec": answer["specdec"],
            "spans": [(s["text"], s["source"]) for s in answer["specdec"]["sources"]], "usage": answer["usage"]}


def chat_once(tool, driver, url: str, question: str = QUESTION, **settings):
    """Open the page, set it up, send ``question`` and wait for the answer to end: its element."""
    tool.open_page(driver, url)
    for name, value in {**SETTINGS, **settings}.items():
        tool.set_field(driver, name, value)
    return tool.send_message(driver, question)


def page_spans(driver, answer) -> list:
    """The answer's spans as [(text, source)]: the source read from each span's class ("tok src-draft")."""
    from specdec.serving.jobs import merge_spans

    rows = driver.execute_script(
        "return Array.from(arguments[0].querySelectorAll('.body > span')).map((s) => [s.textContent, s.className]);",
        answer)
    return merge_spans([(text, cls.replace("tok src-", "") if cls.startswith("tok src-") else cls) for text, cls in rows])


def span_problems(driver, answer, expected: dict) -> list:
    """What the page shows wrong against the API's answer: its text, each span's source, each source's colour
    (the legend's), and the per-message numbers."""
    problems = []
    got = page_spans(driver, answer)
    text = "".join(t for t, _ in got)
    if text != expected["content"]:
        problems.append(f"the page shows {text!r}, the API answered {expected['content']!r}")
    if got != expected["spans"]:
        first = next((i for i, (a, b) in enumerate(zip(got, expected["spans"])) if a != b), min(len(got), len(
            expected["spans"])))
        problems.append(f"span {first}: the page has {got[first:first + 2]}, the API says "
                        f"{expected['spans'][first:first + 2]}")
    colours = driver.execute_script(
        "const out = {}; for (const s of arguments[0].querySelectorAll('.body > span')) {"
        "  out[s.className] = getComputedStyle(s).backgroundColor; }"
        "for (const s of document.querySelectorAll('#legend .tok')) {"
        "  out['legend ' + s.className] = getComputedStyle(s).backgroundColor; } return out;", answer)
    for cls, colour in colours.items():
        if not cls.startswith("legend ") and colours.get("legend " + cls) != colour:
            problems.append(f"{cls!r} is coloured {colour}, the legend's is {colours.get('legend ' + cls)}")
    if len({colours.get(f"legend tok src-{s}") for s in ("draft", "suffix", "lookup", "target")}) != 4:
        problems.append(f"the legend's colours are not distinct: {colours}")
    stats = driver.execute_script(
        "const out = {}; for (const s of arguments[0].querySelectorAll('.stats .stat')) {"
        "  out[s.dataset.stat] = s.querySelector('.value').textContent; } return out;", answer)
    numbers = expected["specdec"]
    want = {"accepted": f"{numbers['accepted_tokens']} / {numbers['proposed_tokens']}",
            "per-pass": f"{expected['usage']['completion_tokens'] / numbers['target_passes']:.2f} tokens"}
    for name, value in want.items():
        if stats.get(name) != value:
            problems.append(f"stat {name}: the page shows {stats.get(name)!r}, the API says {value!r}")
    for name in ("ttft", "tps", "cached"):
        if name not in stats:
            problems.append(f"stat {name} is missing")
    return problems


BROWSER_PAGES = ("chrome:", "chrome-untrusted:", "devtools:")  # Chromium's own pages (its new-tab page), not ours


def requested_urls(driver) -> list:
    """Every URL the page asked for: Chromium's network log since the last call (the requests of Chromium's own
    pages left out) and the page's resource timing."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent" and not message["params"].get(
                "documentURL", "").startswith(BROWSER_PAGES):
            urls.append(message["params"]["request"]["url"])
    urls += driver.execute_script("return performance.getEntries().map((e) => e.name)"
                                  ".filter((n) => n.includes(':'));")
    return urls


def foreign_requests(urls: list, origin: str) -> list:
    def origin_of(url):
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}"

    return [url for url in urls if origin_of(url) != origin]


@pytest.mark.parametrize("variant", ["specdec serve", "planted: the server drops token_sources"])
def test_chat_streams_coloured_spans_matching_the_api(tool, browser, served, decoder, variant, monkeypatch, tmp_path):
    """The page streams the answer and colours it by the sources the API reports for the same greedy request;
    with the sources dropped (a planted server) the check reports it. The page asks nothing of another origin."""
    url = served[0]
    expected = api_answer(url)
    assert {s for _, s in expected["spans"]} >= {"draft", "target"}, "the answer should mix sources"
    browser.get_log("performance")  # drain
    if variant == "specdec serve":
        answer = chat_once(tool, browser, url)
        assert span_problems(browser, answer, expected) == []
        assert foreign_requests(requested_urls(browser), url) == []
        assert browser.save_screenshot(str(tmp_path / "chat.png"))
        assert (tmp_path / "chat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return
    from specdec.serving.dialects import openai as openai_dialect

    monkeypatch.setattr(openai_dialect, "source_block", lambda spans: None)
    with in_process_server(decoder) as planted_url:
        answer = chat_once(tool, browser, planted_url)
        problems = span_problems(browser, answer, expected)
    assert any("span 0" in p for p in problems), problems
    assert page_spans(browser, answer) == [(expected["content"], "none")]  # the text, uncoloured


def test_text_appears_while_it_streams_and_stop_keeps_it(tool, browser, decoder):
    """On a server that takes 0.1 s a piece, the answer's text shows and grows while it streams (the Stop button
    up); Stop ends it, keeps what came, says so, and the page takes the next message."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with in_process_server(decoder, delay=0.1) as url:
        tool.open_page(browser, url)
        for name, value in {**SETTINGS, "proposer": "target-only", "max-tokens": "200"}.items():
            tool.set_field(browser, name, value)
        browser.find_element(By.ID, "input").send_keys(QUESTION)
        browser.find_element(By.ID, "send").click()
        shown = "return document.querySelector('article.message.assistant .body').textContent"
        streaming = "return !document.getElementById('stop').hidden"
        wait = WebDriverWait(browser, 20, poll_frequency=0.05)
        first = wait.until(lambda d: d.execute_script(shown) if d.execute_script(streaming) else None)
        wait.until(lambda d: d.execute_script(streaming) and len(d.execute_script(shown)) > len(first))
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda d: not d.execute_script(streaming))
        kept = browser.execute_script(shown)
        assert kept.startswith(first) and len(kept) > len(first)
        assert browser.execute_script("return document.querySelector('[data-stat=\"finish\"] .value').textContent") \
            == "stopped"
        assert browser.find_element(By.ID, "send").is_displayed()


def _planted_page(tmp_path: Path, old: str = "live.append(span(piece, source));",
                  new: str = "live.innerHTML = reply.content;") -> Path:
    """The page with ``old`` in app.js replaced by ``new`` (by default: each answer re-rendered as HTML on every
    piece, what a Markdown renderer does)."""
    folder = tmp_path / "planted-webui"
    shutil.copytree(WEBUI, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    script = (folder / "app.js").read_text()
    planted = script.replace(old, new)
    assert planted != script, "the plant must change the page"
    (folder / "app.js").write_text(planted)
    return folder


def injection_problems(driver, answer) -> list:
    """What a reply carrying markup did: set the flag its script would set, became elements, or is not shown as
    the literal text."""
    problems = []
    flag = driver.execute_script("return window.__pwned === undefined ? null : window.__pwned")
    if flag is not None:
        problems.append(f"the reply's markup ran (window.__pwned = {flag})")
    tags = driver.execute_script(
        "return Array.from(arguments[0].querySelectorAll('.body *')).map((e) => e.tagName.toLowerCase())"
        ".filter((t) => t !== 'span');", answer)
    if tags:
        problems.append(f"the reply became elements: {sorted(set(tags))}")
    shown = driver.execute_script("return arguments[0].querySelector('.body').textContent", answer)
    if shown != PAYLOAD:
        problems.append(f"the reply is not shown literally: {shown!r}")
    return problems


@pytest.mark.parametrize("variant", ["page", "planted: innerHTML", "planted: innerHTML, no CSP"])
def test_markup_in_a_reply_stays_text(tool, browser, decoder, variant, monkeypatch, tmp_path):
    """A server whose model answers ``<img onerror>`` / ``<script>`` markup (its output constrained to exactly
    that: real tokens, real sources): the page shows it as text and nothing runs. Planted: a page that renders
    replies as HTML is caught (its CSP still stops the handler); without the CSP the handler runs, and a request
    to another origin shows in the network check."""
    from specdec.serving import webui
    from specdec.serving.dialects import openai as openai_dialect
    from specdec.serving.turns import output_constraint

    forced = output_constraint("grammar", grammar=f"root ::= {json.dumps(PAYLOAD)}")
    monkeypatch.setattr(openai_dialect, "body_constraint", lambda body, names: forced)
    options = {}
    if variant != "page":
        options["webui_dir"] = str(_planted_page(tmp_path))
    if variant.endswith("no CSP"):
        monkeypatch.setitem(webui.HEADERS, "Content-Security-Policy", "default-src * 'unsafe-inline'")
    browser.get_log("performance")  # drain
    with in_process_server(decoder, **options) as url:
        answer = chat_once(tool, browser, url, "show me some HTML", **{"max-tokens": "200"})
        problems = injection_problems(browser, answer)
        if variant.endswith("no CSP"):  # a page without its CSP may reach anywhere: the network check sees it
            browser.execute_script("fetch('http://127.0.0.2:9/planted').catch(() => null)")
            browser.execute_script("return new Promise((done) => setTimeout(done, 300))")
        foreign = foreign_requests(requested_urls(browser), url)
    if variant == "page":
        assert problems == [] and foreign == []
    elif variant == "planted: innerHTML":
        assert any("became elements" in p for p in problems) and not any("ran" in p for p in problems), problems
        assert foreign == []  # the CSP stopped it
    else:
        assert any("markup ran" in p for p in problems), problems
        assert set(foreign) == {"http://127.0.0.2:9/planted"}


@pytest.mark.parametrize("variant", ["page", "planted: no second try"])
def test_a_page_opened_while_the_model_loads_waits_for_it(tool, browser, decoder, variant, tmp_path):
    """Opened while the model loads (every route but the page's files answers 503 "Loading model"), the page says
    the model is loading and asks again (Retry-After); once the pool is attached it shows the server's description
    and clears the status. Planted: a page that does not ask again stays on its error without the model's name."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    from served_app import served_app
    from specdec.serving.app import ServerOptions, create_app
    from specdec.serving.pool import DecoderPool, PoolOptions

    options = {}
    if variant != "page":
        options["webui_dir"] = str(_planted_page(tmp_path, "if (error.status === 503) {", "if (false) {"))
    app = create_app(None, ServerOptions(model_name=MODEL, shutdown_grace=1.0, **options))

    def status():
        return browser.execute_script("return document.getElementById('status').textContent")

    with served_app(app, ready_path="/") as (url, _):
        browser.get(url)
        WebDriverWait(browser, 10).until(lambda d: status() != "")
        loading = status()
        app.state.engine.attach(DecoderPool(decoder.fork(), PoolOptions(workers=1, max_queue=2)))
        try:
            WebDriverWait(browser, 10).until(
                lambda d: d.execute_script("return document.getElementById('info-model').textContent") == MODEL)
            described = True
        except TimeoutException:
            described = False
        after = status()
    if variant == "page":
        assert "loading" in loading and described and after == "", (loading, after)
    else:
        assert "HTTP 503" in loading and not described and after == loading


def test_page_headers_and_no_webui(served, decoder):
    """Every page response carries the CSP; with ``webui=False`` (``--no-webui``) ``/`` is a 404 as before."""
    import httpx

    from specdec.serving.webui import CSP, PAGE_FILES

    url = served[0]
    for path in ["/"] + [f"/webui/{name}" for name in PAGE_FILES]:
        response = httpx.get(url + path, timeout=10)
        assert response.status_code == 200, path
        assert response.headers["content-security-policy"] == CSP
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "default-src 'self'" in CSP and "connect-src 'self'" in CSP and "unsafe-inline" not in CSP
    with in_process_server(decoder, webui=False) as bare:
        for path in ("/", "/webui/app.js"):
            response = httpx.get(bare + path, timeout=10)
            assert response.status_code == 404 and "error" in response.json()


def test_screenshot_tool_saves_a_png(tool, served, tmp_path, monkeypatch):
    """tools/check/webui_screenshot.py: the page after a message, as a PNG of the asked size."""
    import struct

    out = tmp_path / "page.png"
    monkeypatch.setattr(sys, "argv", ["webui_screenshot.py", served[0] + "/", str(out), "--message", QUESTION,
                                      "--max-tokens", "24", "--size", "1000x700"])
    assert tool.main() == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1000, 700)
