"""The live console in a real headless browser (Debian's chromium driven by Selenium, no browser
download): it asks for the API key, loads without console errors, its block grid changes while
requests run, a request's block table shows the prefix block it shares with another request
(reference count 2), and the playground streams an answer; a screenshot is kept as an
artifact. The state endpoints are checked as JSON too, and ``--no-console`` turns them off."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request

KEY = "sk-console"
ARTIFACTS = Path(os.environ.get("PAGODA_TEST_ARTIFACTS") or Path(__file__).parent.parent / "test-artifacts")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# NOTE: two requests share this prompt's first blocks (16 tokens each): the second finds them
# in the prefix cache while the first still holds them.
SHARED = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma " * 3
LONG = dict(max_tokens=900, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=1024,
                          num_kv_blocks=600)
    with ServerThread(config, ServerConfig(api_key=KEY)) as server:
        yield server


def test_the_state_is_json_behind_the_key_and_off_with_no_console(server, tiny_llama_dir):
    assert http_request(server.url + "/v1/engine/state").status == 401
    assert http_request(server.url + "/console").status == 200  # the page holds no data
    state = http_request(server.url + "/v1/engine/state", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert state["kv"]["num_blocks"] == 600 and len(state["kv"]["blocks"]) == 600
    assert state["policy"]["scheduling"] == "fcfs" and state["policy"]["plugins"] == []
    bad = http_request(server.url + "/v1/engine/state/stream?interval=0", headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status == 400 and bad.json()["error"]["param"] == "interval"
    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=64,
                          num_kv_blocks=16)
    with ServerThread(config, ServerConfig(console=False)) as plain:
        assert http_request(plain.url + "/console").status == 404
        assert http_request(plain.url + "/v1/engine/state").status == 404


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
                           ".ci/run installs them)")
def test_the_console_in_a_headless_browser(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    threads = []
    try:
        driver.get(server.url + "/console")
        wait.until(lambda d: d.find_element(By.ID, "key").is_displayed())  # the state needs the key
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "live")
        idle = driver.execute_script("return document.getElementById('grid').toDataURL()")

        def run(suffix):
            client.completions.create(model=model, prompt=SHARED + suffix, **LONG)

        threads = [threading.Thread(target=run, args=(suffix,), daemon=True) for suffix in (" one", " two")]
        threads[0].start()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tbody tr")) == 1)
        time.sleep(0.3)  # NOTE: its prompt computed, so that the second finds the blocks cached
        threads[1].start()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tbody tr")) == 2)
        assert int(driver.find_element(By.ID, "kv-counts").get_attribute("data-used")) > 0
        busy = driver.execute_script("return document.getElementById('grid').toDataURL()")
        assert busy != idle  # the grid changed while the requests run
        # The second request's block table: its first block is the first request's too. NOTE: in
        # the page's script, as the table is drawn again with every snapshot.
        driver.execute_script("document.querySelector('#requests tbody tr:last-child').click()")
        refs = wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('#block-table tbody td.ref')].map(td => td.textContent)"))
        assert refs[0] == "2", refs
        # The playground streams an answer.
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("24")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "answer").get_attribute("data-done") == "true")
        assert driver.find_element(By.ID, "answer").text
        assert driver.find_element(By.ID, "answer").get_attribute("data-request-id").startswith("chatcmpl-")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(ARTIFACTS / "console.png"))
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        for request_id in server.call(lambda: list(server.state.running)):
            http_request(server.url + f"/v1/requests/{request_id}/cancel", "POST",
                         headers={"Authorization": f"Bearer {KEY}"})
        for thread in threads:
            thread.join(timeout=60)
        driver.quit()
