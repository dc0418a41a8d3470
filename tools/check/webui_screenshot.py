"""A PNG of specdec's chat page: headless Chromium (Debian's chromium + chromium-driver) driven by selenium.

usage: python tools/check/webui_screenshot.py URL OUT.png [--message TEXT ...] [--proposer NAME] [--draft-tokens N]
                                        [--max-tokens N] [--size 1280x820]

Loads the page at URL (a running `specdec serve`), sends each --message in turn (waiting for each answer to end),
and saves a screenshot. The browser never downloads anything: it is /usr/bin/chromium driven by
/usr/bin/chromedriver (no selenium-manager), with its background services off and every host name but the
loopback's unresolvable. The browser test (tests/serving/test_webui.py) drives the page with the same helpers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# no sandbox (root in a container), no GPU, and none of Chromium's own connections (updates, sync, QUIC probes...)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--disable-extensions", "--disable-default-apps", "--no-default-browser-check",
         "--disable-domain-reliability", "--disable-client-side-phishing-detection",
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost")


def chromium(user_data_dir: str, size: str = "1280x820"):
    """A headless Chromium under chromedriver, its performance log on (every request it makes)."""
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager, were it ever asked, must not download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    width, height = (int(part) for part in size.lower().split("x"))
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    # the page's own viewport at exactly that size (the window's size counts the browser's frame)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    return driver


def open_page(driver, url: str, seconds: float = 20.0) -> None:
    """Load the page and wait until it has read the server's description (the proposer list is filled)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, seconds).until(
        lambda d: d.execute_script("return document.getElementById('proposer').options.length > 1 && "
                                   "document.getElementById('info-model').textContent !== '…'"))


def set_field(driver, element_id: str, value: str) -> None:
    """A setting's value (an input, a textarea, or a select's option value)."""
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1]; "
                          "e.dispatchEvent(new Event('change'));", element_id, value)


def send_message(driver, text: str, seconds: float = 60.0):
    """Type ``text``, send it, wait until the answer has ended (its stats say how); returns the answer's element."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    before = len(driver.find_elements(By.CSS_SELECTOR, "article.message.assistant"))
    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()

    def ended(d):
        answers = d.find_elements(By.CSS_SELECTOR, "article.message.assistant")
        if len(answers) <= before:
            return False
        last = answers[-1]
        done = last.find_elements(By.CSS_SELECTOR, '.stats [data-stat="finish"], .error')
        return last if done and d.find_element(By.ID, "stop").get_attribute("hidden") is not None else False

    return WebDriverWait(driver, seconds, poll_frequency=0.1).until(ended)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--message", action="append", default=[], help="send this (repeat for several turns)")
    parser.add_argument("--proposer", default=None, help="the page's proposer setting (default, draft, suffix, ...)")
    parser.add_argument("--draft-tokens", default=None)
    parser.add_argument("--max-tokens", default=None)
    parser.add_argument("--size", default="1280x820", help="window size WIDTHxHEIGHT")
    args = parser.parse_args()
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing: apt-get install chromium chromium-driver")
    with tempfile.TemporaryDirectory(prefix="specdec-chromium-") as profile:
        driver = chromium(profile, args.size)
        try:
            open_page(driver, args.url)
            for element_id, value in (("proposer", args.proposer), ("draft-tokens", args.draft_tokens),
                                      ("max-tokens", args.max_tokens)):
                if value is not None:
                    set_field(driver, element_id, value)
            for message in args.message:
                send_message(driver, message)
            time.sleep(0.2)  # the last layout pass
            if not driver.save_screenshot(args.out):
                raise SystemExit(f"could not write {args.out}")
        finally:
            driver.quit()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
