"""The page of ``fastgen-diffusers serve`` in a real browser: headless Chromium (Debian's ``chromium``) driven by
Playwright against a real server serving the tiny model. The page's screenshot is a test artefact in the test's tmp
directory; with ``FASTGEN_UPDATE_DOCS_SCREENSHOT=1`` it replaces ``docs/serve.png`` (the README's) instead."""

import os
import re
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("fastapi")

from serve_helpers import running_server  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "serve.png"
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")

FRAMES_SHOWN = "() => /frames: ([1-9]\\d*)/.test(document.getElementById('status').textContent)"
CHROMIUM_ARGS = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream", "--no-sandbox"]


def frames_shown(page) -> int:
    return int(re.search(r"frames: (\d+)", page.locator("#status").inner_text()).group(1))


def screen_is_painted(page) -> bool:
    """Whether the canvas holds a frame that is not one flat colour."""
    return page.evaluate(
        """() => {
        const c = document.getElementById('screen');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let min = 255, max = 0;
        for (let i = 0; i < d.length; i += 4) { min = Math.min(min, d[i]); max = Math.max(max, d[i]); }
        return max - min > 10;
    }"""
    )


@pytest.fixture(scope="module")
def browser_page():
    with running_server() as (address, _), sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(f"http://{address}/")
        for field, value in (("#height", "32"), ("#width", "32"), ("#steps", "2")):
            page.fill(field, value)
        yield page
        browser.close()


def screenshot_path(tmp_path: Path) -> Path:
    """Where the page's screenshot goes: the test's tmp directory, or ``docs/serve.png`` when
    ``FASTGEN_UPDATE_DOCS_SCREENSHOT=1`` (so that a test run leaves the tree as it was)."""
    if os.environ.get("FASTGEN_UPDATE_DOCS_SCREENSHOT") == "1":
        return DOCS_SCREENSHOT
    return tmp_path / "serve.png"


def test_screenshot_goes_to_docs_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTGEN_UPDATE_DOCS_SCREENSHOT", raising=False)
    assert screenshot_path(tmp_path) == tmp_path / "serve.png"
    monkeypatch.setenv("FASTGEN_UPDATE_DOCS_SCREENSHOT", "1")
    assert screenshot_path(tmp_path) == DOCS_SCREENSHOT


def test_the_page_streams_a_prompt_changes_it_live_and_stops(browser_page, tmp_path):
    page = browser_page
    page.fill("#prompt", "a red fox running through snow")
    page.click("#start")
    page.wait_for_function("() => /frames: ([1-9]\\d*)/.test(document.getElementById('status').textContent)")
    assert screen_is_painted(page)
    counted = frames_shown(page)
    page.fill("#prompt", "a blue whale under the sea")
    page.click("#apply")
    page.wait_for_function("() => document.getElementById('log').textContent.includes('prompt changes at chunk')")
    changed = frames_shown(page)
    page.wait_for_function(
        f"() => Number(/frames: (\\d+)/.exec(document.getElementById('status').textContent)[1]) > {changed}"
    )
    screenshot = screenshot_path(tmp_path)
    page.screenshot(path=str(screenshot))
    assert screenshot.stat().st_size > 0
    page.click("#stop")
    page.wait_for_function("() => document.getElementById('start').disabled === false")
    assert frames_shown(page) > counted


def test_the_camera_path_restyles_chromiums_fake_camera(browser_page):
    page = browser_page
    page.select_option("#input", "camera")
    page.click("#start")
    page.wait_for_function(
        "() => /frames: ([1-9]\\d*)/.test(document.getElementById('status').textContent)", timeout=60000
    )
    assert screen_is_painted(page)
    page.click("#stop")
    page.wait_for_function("() => document.getElementById('start').disabled === false")
    assert page.locator("#log").inner_text() == ""


def test_the_file_path_restyles_a_chosen_video(browser_page, tmp_path):
    import imageio
    import numpy as np

    path = tmp_path / "input.webm"
    with imageio.get_writer(
        path, fps=16, codec="libvpx", macro_block_size=16, output_params=["-b:v", "200k"]
    ) as writer:
        for k in range(32):
            frame = np.zeros((64, 64, 3), np.uint8)
            frame[16:48, 2 * k % 48 : 2 * k % 48 + 16] = 255
            writer.append_data(frame)
    page = browser_page
    page.select_option("#input", "file")
    page.set_input_files("#file", str(path))
    page.click("#start")
    page.wait_for_function(FRAMES_SHOWN, timeout=60000)
    assert screen_is_painted(page)
    page.click("#stop")
    page.wait_for_function("() => document.getElementById('start').disabled === false")
    assert page.locator("#log").inner_text() == ""
