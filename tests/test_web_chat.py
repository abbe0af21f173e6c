"""The web chat page in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): it loads, sends a message, renders the streamed answer with its token rate, and the stop
button aborts a long answer, after which /metrics shows the request freed. The server is the real
app and engine loop over tests/fixtures/fake_runner.py (fast, no model). Skips when Chromium is not installed,
except in CI (``CI`` set), where .ci/run installs it.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.app import create_app
from engine.server.model_info import ModelInfo
from engine.server.serve import BackgroundServer
from engine.server_config import ApiKey, ServerConfig, hash_key

KEY = "sk-web-test"
CHROME = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver") if (CHROME and DRIVER) or os.environ.get("CI") else None
if webdriver is None:
    pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)", allow_module_level=True)


class _Tok:
    """tests/fixtures/fake_runner.py's tokenizer plus a plain chat template."""

    def __init__(self):
        from fixtures.fake_runner import FakeTokenizer

        self._t = FakeTokenizer()
        self.eos_token_ids = self._t.eos_token_ids
        self.vocab_size = self._t.vocab_size

    def __getattr__(self, name):
        return getattr(self._t, name)

    def encode(self, text, add_special_tokens=False, scope=None):
        return self._t.encode(text)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, **kw):
        return "".join(f"{m['role']}: {m.get('content') or ''} | " for m in messages) + "assistant: "


@pytest.fixture(scope="module")
def page():
    from fixtures.fake_runner import FakeRunner
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    from engine.loop import Engine, EngineConfig

    tok = _Tok()
    runner = FakeRunner(num_blocks=256, block_size=16, max_model_len=2048, vocab_size=128, step_delay_s=0.01)
    eng = Engine(runner, tok, EngineConfig(max_running=4))
    eng.start()
    cfg = ServerConfig(keys=(ApiKey("key_w", hash_key(KEY), "w1"),), keepalive_s=1.0)
    app = create_app(eng, tok, ModelInfo("fake-runner", 2048, "fake", 1), cfg)
    opts = Options()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    if CHROME:
        opts.binary_location = CHROME
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER or "chromedriver"))
    driver.set_page_load_timeout(20)
    with BackgroundServer(app) as srv:
        try:
            yield driver, srv.url, eng
        finally:
            driver.quit()
    eng.check_invariants()
    eng.shutdown(5.0)


def _wait(pred, timeout=15.0):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def _send(driver, text: str, max_tokens: int) -> object:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "maxtokens")
    box.clear()
    box.send_keys(str(max_tokens))
    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()
    return _wait(lambda: (m := driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))[before:] and m[before])


def test_chat_page_streams_and_stop_frees_the_request(page):
    from selenium.webdriver.common.by import By

    driver, url, eng = page
    driver.get(url + "/")
    assert driver.title == "memra chat"
    driver.find_element(By.ID, "apikey").send_keys(KEY)
    driver.find_element(By.ID, "temperature").send_keys("0")  # greedy: the same answer every run
    # a short answer: streamed, rendered, with its token count and rate
    msg = _send(driver, "Hello there", 24)
    _wait(lambda: msg.get_attribute("data-done") == "1")
    assert "error" not in msg.get_attribute("class"), msg.text
    assert msg.find_element(By.CSS_SELECTOR, ".content").text.strip()
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").text
    assert "tokens" in stats and "tok/s" in stats, stats
    # a long answer, stopped mid-stream: the engine frees the request
    msg = _send(driver, "Tell me everything", 1500)
    _wait(lambda: len(msg.find_element(By.CSS_SELECTOR, ".content").text) > 20)
    assert _metric(url, "vllm:num_requests_running") == 1
    driver.find_element(By.ID, "stop").click()
    _wait(lambda: msg.get_attribute("data-done") == "stopped")
    _wait(lambda: _metric(url, "vllm:num_requests_running") == 0 and _metric(url, "memra_requests_in_flight") == 0)
    assert _metric(url, "memra_client_disconnects_total") >= 1
    assert eng.stats().kv_blocks_used == 0
    assert driver.find_element(By.ID, "send").is_enabled()
