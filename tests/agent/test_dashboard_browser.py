"""The dashboard in a real browser: Debian's headless chromium driven by Selenium through
chromium-driver (no browser download), against a real cluster of three agent processes on
loopback, each serving its HTTP API (and so the dashboard) on its own address.

One test walks the story, since each step needs the cluster the one before built (forming
and serving a model is most of the time): the three Macs appear in the picture; a model is
set and the page shows it serving; a chat message streams a reply into the chat panel; a
Mac SIGKILLed turns red and then leaves the ring. Screenshots, light and dark, are taken
with a Mac down; with P2PMESH_DASHBOARD_SHOTS=DIR they are also copied there (docs/ holds
the ones docs/dashboard.md shows).

Without chromium, chromium-driver or selenium the test skips and says which is missing;
under CI=true it fails instead (scripts/_bootstrap.sh installs them where it may).
"""
from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import AgentProc, control_status, free_port, loopback_agents, make_model, wait_for

LAYERS = 6
CONTEXT = 256
FORM_TIMEOUT_S = 40
SERVE_TIMEOUT_S = 60
PAGE_TIMEOUT_S = 20
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def _browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists() and shutil.which(Path(path).name) is None:
            return f"{path} is missing (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is missing (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the dashboard's browser test cannot run in CI: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or CHROMEDRIVER), options=options)
    try:
        # The page's viewport, not the window (headless chromium's window has no frame, but
        # be exact): what a laptop's browser shows.
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
        driver.set_page_load_timeout(PAGE_TIMEOUT_S)
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", family="llama", layers=LAYERS, hidden=64, seed=5)


def _memory_for(model: Path, layers: float) -> int:
    """A memory limit with room for ``layers`` layers (their KV cache included) and the embeddings."""
    from p2pmesh.agent.models import describe

    info = describe(str(model), model, CONTEXT)
    return int(info.embed_bytes + (info.layer_bytes + info.kv_bytes_per_token_per_layer * CONTEXT) * layers)


@pytest.fixture
def agents(tmp_path: Path, model: Path) -> Iterator[list[AgentProc]]:
    """Three agents on 127.0.0.2-4, one peer port, each with its HTTP API on its own address,
    each with room for half the model's layers and a bit: it takes two or three Macs, and
    two still hold it when the third is killed."""
    memory = str(_memory_for(model, LAYERS / 2 + 0.5))
    out = loopback_agents(tmp_path, 3, 7, lambda i, host: ["--http", f"{host}:{free_port(host)}", "--memory-limit", memory])
    try:
        for a in out:
            a.start()
        yield out
    finally:
        for a in out:
            a.stop()


def _url(a: AgentProc) -> str:
    return "http://" + a.extra[a.extra.index("--http") + 1]


def _formed(agents: list[AgentProc]) -> dict[str, Any] | None:
    s = control_status(agents[0])
    if not s or not s.get("healthy") or len(s["members"]) != len(agents) or not all(m["up"] for m in s["members"]):
        return None
    ring = s.get("ring") or {}
    return s if len(ring.get("order") or ()) == len(agents) else None


def _text(driver: Any, css: str) -> str:
    """The text of the first element matching ``css``, read in one script: the page redraws
    its live parts on every status event, so an element found in one call may be gone by
    the next (selenium's stale element)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)


def _nodes(driver: Any) -> dict[str, dict[str, str]]:
    """The Macs the picture shows: node id -> their data attributes."""
    return driver.execute_script("""
        const out = {};
        for (const g of document.querySelectorAll('#topology g.node'))
            out[g.dataset.nodeId] = {up: g.dataset.up, inRing: g.dataset.inRing, cls: g.getAttribute('class')};
        return out;""")


def test_the_dashboard_shows_the_cluster_live_and_chats(browser: Any, agents: list[AgentProc], model: Path,
                                                       tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    formed = wait_for(lambda: _formed(agents), FORM_TIMEOUT_S, "one cluster of 3 with a 3-Mac ring")
    ids = [control_status(a)["node_id"] for a in agents]  # type: ignore[index]
    driver.get(_url(agents[0]) + "/")

    # The members appear, all up and in the ring, this Mac and the leader marked.
    shown = wait_for(lambda: (n := _nodes(driver)) and set(n) == set(ids) and n, PAGE_TIMEOUT_S, "the 3 Macs in the picture")
    assert all(v["up"] == "true" and v["inRing"] == "true" for v in shown.values()), shown
    assert "leader" in shown[formed["leader"]]["cls"]
    assert _text(driver, "#link").strip() == "live"
    assert "this Mac" in _text(driver, f'#topology g.node[data-node-id="{ids[0]}"]')

    # A model: the placement and the event log follow the cluster.
    from p2pmesh.client import Client

    Client(agents[0].state_dir / "agent.sock").set_model(model, context_tokens=CONTEXT)
    wait_for(lambda: " · serving · " in _text(driver, "#model"), SERVE_TIMEOUT_S,
             "the page showing the model serving")
    assert driver.find_elements(By.CSS_SELECTOR, "#stages .stage"), "no stage drawn"
    kinds = set(driver.execute_script("return [...document.querySelectorAll('#log li')].map((e) => e.dataset.kind)"))
    assert {"plan_committed", "plan_activated"} <= kinds, kinds

    # A chat message streams a reply into the chat panel (counted: more than one update).
    driver.execute_script("""
        window.__updates = 0;
        new MutationObserver((records) => {
            for (const r of records) if (r.target.closest && r.target.closest('.msg.assistant')) window.__updates++;
        }).observe(document.getElementById('chat-log'), {childList: true, subtree: true, characterData: true});""")
    box = driver.find_element(By.ID, "chat-input")
    box.send_keys("Hello, cluster!")
    driver.find_element(By.ID, "chat-send").click()
    reply = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, '#chat-log .msg.assistant[data-done="true"]'),
                     SERVE_TIMEOUT_S, "the chat reply")[0]
    assert not driver.find_elements(By.CSS_SELECTOR, "#chat-log .msg.error"), driver.find_element(By.ID, "chat-log").text
    assert reply.text.strip(), "an empty reply"
    assert driver.execute_script("return window.__updates") >= 2, "the reply arrived in one piece, not streamed"
    assert driver.find_element(By.CSS_SELECTOR, "#chat-log .msg.user").text == "Hello, cluster!"

    # A Mac killed: red in the picture, then out of the ring.
    victim = ids[2]
    agents[2].signal(signal.SIGKILL)
    wait_for(lambda: _nodes(driver).get(victim, {}).get("up") == "false", FORM_TIMEOUT_S, "the killed Mac drawn down")
    assert "down" in _nodes(driver)[victim]["cls"]
    shots = _screenshots(driver, tmp_path)
    wait_for(lambda: (n := _nodes(driver)) and n.get(victim, {}).get("inRing") != "true"
             and sum(v["inRing"] == "true" for v in n.values()) == 2, FORM_TIMEOUT_S, "the killed Mac out of the ring")
    kinds = set(driver.execute_script("return [...document.querySelectorAll('#log li')].map((e) => e.dataset.kind)"))
    assert {"member_down", "ring_changed"} <= kinds, kinds
    for shot in shots:
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shots[0].read_bytes() != shots[1].read_bytes()
    keep = os.environ.get("P2PMESH_DASHBOARD_SHOTS")
    if keep:
        for shot in shots:
            shutil.copy(shot, Path(keep) / shot.name)


def _screenshots(driver: Any, out: Path) -> list[Path]:
    """Light, then dark (prefers-color-scheme emulated through the DevTools protocol)."""
    shots = []
    for scheme in ("light", "dark"):
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
        wait_for(lambda: driver.execute_script(f"return matchMedia('(prefers-color-scheme: {scheme})').matches"), 5,
                 f"{scheme} mode")
        path = out / f"dashboard-{scheme}.png"
        driver.save_screenshot(str(path))
        shots.append(path)
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
    return shots
