"""Notebook 01 as a reader meets it: JupyterLab in headless Chromium, run all, change the chip.

The test starts JupyterLab on 127.0.0.1 (a free port, a token, settings and runtime files in the
test's tmp dir) over a copy of notebook 01, opens it in headless Chromium through Selenium, runs
every cell, then picks another chip in the timeline explorer and checks that the summary line
changes, that the redrawn figure replaces the static one and that no widget failed to render.
Then it saves the notebook, shuts the kernel down and reopens the page: the widget's model is
gone, and the figure must still show (the static PNG). Screenshots: <tmp dir>/notebook01.png
and notebook01_reopened.png.

Chromium and chromedriver are Debian's packages (`make browser` installs them as root); where
they, or Python's selenium, are missing the test skips and says which.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_vmem_pipelining.ipynb"
TOKEN = "mkresearch-browser-test"
RUN_ALL_TIMEOUT_S = 300


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return (f"{path} is missing: install Debian's chromium and chromium-driver "
                    "(`make browser` does, as root)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "Python selenium is missing: pip install -e '.[dev]'"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of notebook 01 (autosave must not touch the committed one)."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell stays in the page, so the test sees all of them without scrolling
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = os.environ | {"JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
                        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
                        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
                        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    port = _free_port()
    log = (tmp_path / "lab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
         "--allow-root",  # CI runs as root
         "--LabApp.extension_manager=readonly", "--LabApp.expose_app_in_browser=True"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'lab.log').read_text()}")
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # without the background-networking flags Chromium's own connections are refused here
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


# JupyterLab's own model, through window.jupyterapp (--LabApp.expose_app_in_browser)
_NOTEBOOK_STATE = """
const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!panel || !panel.sessionContext || !panel.content || !panel.content.model) return null;
const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
const cells = Array.from(panel.content.model.cells).filter(c => c.type === 'code');
const errors = cells.flatMap(c => Array.from({length: c.outputs.length}, (_, i) => c.outputs.get(i))
    .filter(o => o.type === 'error')
    .map(o => `${o.toJSON().ename}: ${o.toJSON().evalue}\n${c.sharedModel.getSource()}`));
return {kernel: kernel ? kernel.status : null, counts: cells.map(c => c.executionCount),
        errors: errors};
"""


def _wait(driver, condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _command(driver, name):
    driver.execute_script(f"return window.jupyterapp.commands.execute({name!r});")


def test_notebook_01_runs_and_its_chip_control_redraws(lab, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(f"{lab}/lab/tree/{NOTEBOOK.name}?token={TOKEN}")
    _wait(browser, lambda: (browser.execute_script(_NOTEBOOK_STATE) or {}).get("kernel") == "idle",
          120, "the notebook to open with an idle kernel")
    _command(browser, "notebook:clear-all-cell-outputs")
    _command(browser, "notebook:run-all-cells")

    def finished():
        state = browser.execute_script(_NOTEBOOK_STATE)
        if state["errors"]:
            pytest.fail("a cell failed: " + "\n\n".join(state["errors"]))
        return state["kernel"] == "idle" and all(c is not None for c in state["counts"])

    _wait(browser, finished, RUN_ALL_TIMEOUT_S, "every cell of notebook 01 to run")

    def dropdowns(label):
        return browser.find_elements(By.XPATH, "//div[contains(@class, 'widget-dropdown')]"
                                               f"[label[normalize-space()='{label}']]//select")

    chip = _wait(browser, lambda: dropdowns("chip"), 30, "the explorer's chip dropdown")[0]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", chip)
    assert Select(dropdowns("buffers")[0]).first_selected_option.text == "as recorded"
    explorer = chip.find_element(By.XPATH, "ancestor::div[contains(@class, 'mkresearch-explorer-')]")
    summary = explorer.find_element(By.CSS_SELECTOR, ".widget-html-content")
    before = summary.text
    assert "of roofline" in before and "compute idle: HBM busy" in before
    # before any change the figure is the static output above the widget
    output_children = explorer.find_elements(
        By.XPATH, "ancestor::div[contains(@class, 'jp-OutputArea-child')]/"
                  "preceding-sibling::div[contains(@class, 'jp-OutputArea-child')][1]//img")
    assert output_children and output_children[0].is_displayed()

    Select(chip).select_by_visible_text("v5e")
    _wait(browser, lambda: summary.text != before, 60, "the summary line to change")
    _wait(browser, lambda: explorer.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img"),
          60, "the redrawn figure inside the widget")
    assert not output_children[0].is_displayed()  # the stale static figure is hidden
    page = browser.find_element(By.TAG_NAME, "body").text
    assert "Error displaying widget" not in page
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", explorer)
    time.sleep(1)  # let the new image paint
    screenshot = tmp_path / "notebook01.png"
    browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000
    print(f"summary before: {before}\nsummary after:  {summary.text}\nscreenshot: {screenshot}")

    # Saved, kernel gone, reopened: the widget's model is lost, the figure must still show.
    _command(browser, "docmanager:save")
    _wait(browser, lambda: browser.execute_script(
        "return !window.jupyterapp.shell.currentWidget.context.model.dirty;"), 30, "the save")
    browser.execute_script("await window.jupyterapp.shell.currentWidget.sessionContext.shutdown();")
    browser.refresh()
    _wait(browser, lambda: (browser.execute_script(_NOTEBOOK_STATE) or {}).get("kernel") == "idle",
          120, "the reopened notebook")
    explorer_cell = _wait(browser, lambda: browser.execute_script(
        "return window.jupyterapp.shell.currentWidget.content.widgets"
        ".find(c => c.model.sharedModel.getSource().includes('widgets.show(')).node;"),
        30, "the explorer's cell")
    images = _wait(browser, lambda: [img for img in explorer_cell.find_elements(
        By.CSS_SELECTOR, ".jp-OutputArea-output img") if img.is_displayed()],
        30, "the explorer's figure in the reopened notebook")
    assert len(images) == 1
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", images[0])
    time.sleep(1)
    browser.save_screenshot(str(tmp_path / "notebook01_reopened.png"))
