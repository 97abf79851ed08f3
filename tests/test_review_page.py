"""`reservoir review serve` as a real process, clicked through in a real headless Chromium
(Debian's chromium, driven by Playwright): accept, reject, label and a preference, each checked
in the store with its review_actions row; writes without the token are refused; stored text is
shown escaped. Set RESERVOIR_SCREENSHOTS=DIR to keep the page's screenshots there."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from tests.factories import make_group
from tests.test_recovery import query, start, wait_for
from tests.test_serve import free_port, responds

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HOSTILE = "<script>document.title='owned'</script><b>bold?</b>"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).is_file() and not os.environ.get("RESERVOIR_REQUIRE_BROWSER"),
    reason="needs Debian's chromium (apt install chromium)")


@pytest.fixture
def held(store):
    """Three held rows with pending reviews, and a group of four different responses."""
    run_id = store.create_run("r")
    groups = [make_group("r", seed=seed) for seed in range(4)]
    groups[2][0].response_text = HOSTILE
    store.write_groups(groups, status="raw")
    with store.engine.begin() as conn:
        held_ids = conn.execute(text("SELECT id FROM experiences WHERE group_row = 0 "
                                     "ORDER BY id LIMIT 3")).scalars().all()
        conn.execute(text("UPDATE experiences SET status = CASE WHEN id = ANY(:ids) "
                          "THEN 'held' ELSE 'ready' END"), {"ids": held_ids})
        for experience_id in held_ids:
            conn.execute(text("INSERT INTO reviews (experience_id, reason) VALUES (:e, "
                              "'reward near the threshold')"), {"e": experience_id})
    return run_id, held_ids


@pytest.fixture
def page_server(tmp_path, db_url):
    port = free_port()
    os.environ["RESERVOIR_REVIEW_TOKEN"] = "review-token"
    os.environ["RESERVOIR_DB_URL"] = db_url
    try:
        process = start("review", "serve", "--port", str(port), cwd=tmp_path)
    finally:
        del os.environ["RESERVOIR_REVIEW_TOKEN"], os.environ["RESERVOIR_DB_URL"]
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: process.poll() is not None or responds(f"{url}/login"), timeout=120)
    assert process.poll() is None, process.stdout.read()
    yield url
    os.killpg(process.pid, signal.SIGINT)
    process.communicate(timeout=60)


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"])
        yield launched
        launched.close()


def screenshot(page, tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("RESERVOIR_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 5_000
    return path


def test_a_person_accepts_rejects_labels_and_prefers_in_the_browser(
        held, page_server, browser, db_url, tmp_path):
    _, (first, second, third) = held
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(page_server + "/")
    assert page.locator(".card").count() == 3 and page.locator("form button").count() == 0
    assert HOSTILE in page.inner_text("#review-3") and page.title() != "owned"
    page.click("text=log in to review")
    page.fill("input[name=reviewer]", "ana")
    page.fill("input[name=token]", "review-token")
    page.click("button:has-text('log in')")
    assert page.inner_text("header .who").startswith("ana")
    screenshot(page, tmp_path, "review_page")

    card = page.locator("#review-1")
    card.locator("input[name=note]").fill("clear and right")
    card.locator("input[name=tags]").fill("good, short")
    card.locator("button:has-text('accept')").click()
    assert "done: accept 1" in page.inner_text(".done")
    page.locator("#review-2 button:has-text('reject')").click()
    page.locator("#review-3 input[name=note]").fill("ask a second reviewer")
    page.locator("#review-3 button:has-text('save label')").click()
    assert page.locator(".card").count() == 1  # only the labelled, undecided one is left

    assert query(db_url, "SELECT id, status FROM experiences WHERE id = ANY(:ids) ORDER BY id",
                 ids=[first, second, third]) == [(first, "ready"), (second, "quarantined"),
                                                 (third, "held")]
    assert query(db_url, "SELECT id, status, verdict, reviewer, label FROM reviews ORDER BY id"
                 ) == [(1, "labelled", "accept", "ana",
                        {"note": "clear and right", "tags": ["good", "short"]}),
                       (2, "labelled", "reject", "ana", {}),
                       (3, "pending", None, None, {"note": "ask a second reviewer"})]

    page.click("header a:has-text('compare')")
    choices = page.locator(".pair .card")
    assert choices.count() == 2
    ids = [int(card_id.removeprefix("choice-")) for card_id in
           (choices.nth(0).get_attribute("id"), choices.nth(1).get_attribute("id"))]
    screenshot(page, tmp_path, "compare_page")
    choices.nth(1).locator("button").click()
    assert "done: prefer" in page.inner_text(".done")
    assert query(db_url, "SELECT chosen_id, rejected_id, source, status FROM preferences") == [
        (ids[1], ids[0], "review:ana", "ready")]

    assert query(db_url, "SELECT reviewer, action, source, review_id, experience_id, "
                         "preference_id IS NOT NULL FROM review_actions ORDER BY id") == [
        ("ana", "accept", "web", 1, first, False), ("ana", "reject", "web", 2, second, False),
        ("ana", "label", "web", 3, third, False), ("ana", "prefer", "web", None, ids[1], True)]
    page.click("header a:has-text('actions')")
    assert page.locator("table tr").count() == 5


def test_writes_need_the_token_a_session_and_its_form_token(held, page_server, db_url):
    before = query(db_url, "SELECT count(*) FROM review_actions")[0][0], \
        query(db_url, "SELECT array_agg(status ORDER BY id) FROM reviews")[0][0]
    anonymous = httpx.post(f"{page_server}/reviews/1", data={"action": "accept", "csrf": ""})
    assert anonymous.status_code == 401
    wrong = httpx.post(f"{page_server}/login", data={"reviewer": "eve", "token": "guess"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    with httpx.Client(base_url=page_server) as client:
        logged = client.post("/login", data={"reviewer": "eve", "token": "review-token"})
        assert logged.status_code == 303
        forged = client.post("/reviews/1", data={"action": "accept", "csrf": "forged"})
        assert forged.status_code == 403
        bad_action = client.post("/prefer", data={"chosen": "1; DROP TABLE runs", "rejected": 2})
        assert bad_action.status_code == 422
    assert (query(db_url, "SELECT count(*) FROM review_actions")[0][0],
            query(db_url, "SELECT array_agg(status ORDER BY id) FROM reviews")[0][0]) == before
