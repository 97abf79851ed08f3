"""`reservoir review serve` as a real process, clicked through in a real headless Chromium
(Debian's chromium, driven by Playwright): accept, reject, label and a preference, each checked
in the store with its review_actions row; writes without the token are refused; stored text is
shown escaped. Set RESERVOIR_SCREENSHOTS=DIR to keep the page's screenshots there."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from tests.commands import RESERVOIR, command_env
from tests.factories import make_group
from tests.test_recovery import query, start, wait_for
from tests.test_serve import free_port, responds, served  # noqa: F401 (a fixture)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HOSTILE = "<script>document.title='owned'</script><b>bold?</b>"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not Path(CHROMIUM).is_file() and not os.environ.get("RESERVOIR_REQUIRE_BROWSER"),
    reason="needs Debian's chromium (apt install chromium)")]


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


TOKEN = "rv-9Q2mXk4TzL7pW1aB"  # 16+ characters, many of them different


@pytest.fixture
def review_server(tmp_path, db_url):
    """A function starting `reservoir review serve ARGS` with a token (None: none set);
    returns (url, process), the page up, or the process that ended."""
    processes = []

    def serve(*args: str, token: str | None = TOKEN):
        port = free_port()
        env = {"RESERVOIR_DB_URL": db_url, **({"RESERVOIR_REVIEW_TOKEN": token} if token else {})}
        os.environ.update(env)
        try:
            process = start("review", "serve", "--port", str(port), *args, cwd=tmp_path)
        finally:
            for name in env:
                del os.environ[name]
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: process.poll() is not None or responds(f"{url}/login"), timeout=120)
        return url, process

    yield serve
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            process.communicate(timeout=60)


@pytest.fixture
def page_server(review_server):
    url, process = review_server()
    assert process.poll() is None, process.stdout.read()
    return url


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


@pytest.mark.browser
def test_a_person_accepts_rejects_labels_and_prefers_in_the_browser(
        held, page_server, browser, db_url, tmp_path):
    _, (first, second, third) = held
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(page_server + "/")
    assert page.locator(".card").count() == 3 and page.locator("form button").count() == 0
    assert HOSTILE in page.inner_text("#review-3") and page.title() != "owned"
    page.click("text=log in to review")
    page.fill("input[name=reviewer]", "ana")
    page.fill("input[name=token]", TOKEN)
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
        logged = client.post("/login", data={"reviewer": "eve", "token": TOKEN})
        assert logged.status_code == 303
        forged = client.post("/reviews/1", data={"action": "accept", "csrf": "forged"})
        assert forged.status_code == 403
        bad_action = client.post("/prefer", data={"chosen": "1; DROP TABLE runs", "rejected": 2})
        assert bad_action.status_code == 422
    assert (query(db_url, "SELECT count(*) FROM review_actions")[0][0],
            query(db_url, "SELECT array_agg(status ORDER BY id) FROM reviews")[0][0]) == before
    from tests.test_metrics import scrape

    got = scrape(f"{page_server}/metrics")  # every refusal counted, by kind
    assert got[("reservoir_review_failed_logins_total",)] == 1
    assert got[("reservoir_http_errors_total", ("kind", "401"))] == 2
    assert (got[("reservoir_http_errors_total", ("kind", "403"))],
            got[("reservoir_http_errors_total", ("kind", "422"))]) == (1, 1)
    assert got[("reservoir_http_requests_total", ("method", "POST"), ("route", "/login"),
                ("status", "303"))] == 1
    assert not any(name == "reservoir_review_actions_total" for name, *_ in got)


# -- issue 28: a page for one run, tokens, logins and sessions, pairs, turns -----------------

def log_in(client: httpx.Client, reviewer: str = "ana") -> str:
    """Log in; the form token (csrf) of the session."""
    assert client.post("/login", data={"reviewer": reviewer, "token": TOKEN}).status_code == 303
    return re.search(r'name="csrf" value="([^"]+)"', client.get("/compare").text
                     + client.get("/").text).group(1)


@pytest.mark.process
def test_a_page_for_one_run_changes_no_other_run(store, review_server, db_url):
    """Started with --run a, it took a review of run b's row and stored a pair of run b."""
    for run in ("a", "b"):
        store.create_run(run)
        store.write_groups([make_group(run, seed=1)], status="raw")
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE experiences SET status = 'held' WHERE group_row = 0"))
        conn.execute(text("INSERT INTO reviews (experience_id, reason) SELECT id, 'check' "
                          "FROM experiences WHERE group_row = 0 ORDER BY id"))
    in_b = "(SELECT id FROM runs WHERE name = 'b')"
    other = query(db_url, "SELECT r.id FROM reviews r JOIN experiences e ON e.id = "
                          f"r.experience_id WHERE e.run_id = {in_b}")[0][0]
    pair = [row[0] for row in query(db_url, f"SELECT id FROM experiences WHERE run_id = {in_b} "
                                            "ORDER BY id LIMIT 2")]
    url, _ = review_server("--run", "a")
    with httpx.Client(base_url=url) as client:
        csrf = log_in(client)
        assert client.post(f"/reviews/{other}", data={"action": "accept",
                                                       "csrf": csrf}).status_code == 404
        assert client.post("/prefer", data={"chosen": pair[0], "rejected": pair[1],
                                            "csrf": csrf}).status_code == 404
    assert query(db_url, "SELECT status, verdict FROM reviews WHERE id = :id", id=other) == [
        ("pending", None)]
    assert query(db_url, "SELECT count(*) FROM preferences") == [(0,)]


@pytest.mark.process
def test_tokens_logins_and_sessions(held, review_server):
    """Any token was taken (even 'a'); a made one was printed inside a GET URL; logins could
    be guessed ~200 times a second; a cookie had no expiry and worked after logout."""
    for weak in ("a", "review-token", "aaaaaaaaaaaaaaaaaaaa"):
        _, refused = review_server(token=weak)
        output = refused.communicate(timeout=120)[0].strip().splitlines()
        assert refused.returncode == 1 and output[-1].startswith(
            "error: RESERVOIR_REVIEW_TOKEN: a token is at least 16 characters"), output
    url, made = review_server(token=None)
    assert made.poll() is None
    with httpx.Client(base_url=url) as client:
        assert "prefilled-token" not in client.get("/login?token=prefilled-token").text
    url, _ = review_server()
    with httpx.Client(base_url=url) as client:
        logged = client.post("/login", data={"reviewer": "ana", "token": TOKEN})
        assert "max-age=43200" in logged.headers["set-cookie"].lower()
        cookie = client.cookies.get("reservoir_review")
        assert client.post("/logout").status_code == 303
    with httpx.Client(base_url=url, cookies={"reservoir_review": cookie}) as stale:
        assert stale.post("/reviews/1", data={"action": "accept", "csrf": "x"}
                          ).status_code == 401
    began, statuses = time.monotonic(), []
    for guess in range(12):
        statuses.append(httpx.post(f"{url}/login", data={"reviewer": "eve",
                                                         "token": f"guess-{guess}"}).status_code)
    assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}, statuses
    assert time.monotonic() - began >= 2.0


@pytest.mark.process
def test_pairs_compare_responses_to_one_prompt(store, review_server, db_url, tmp_path):
    """Served rows have no task: a pair of two episodes' responses (two prompts) was taken."""
    store.create_run("served")
    store.write_groups([make_group("served", seed=1, size=2), make_group("served", seed=2,
                                                                          size=2)])
    ids = [row[0] for row in query(db_url, "SELECT id FROM experiences ORDER BY id")]
    url, _ = review_server()
    with httpx.Client(base_url=url) as client:
        csrf = log_in(client)
        refused = client.post("/prefer", data={"chosen": ids[0], "rejected": ids[2],
                                               "csrf": csrf})
        assert refused.status_code == 409 and "one prompt" in refused.text
        assert client.post("/prefer", data={"chosen": ids[0], "rejected": ids[1],
                                            "csrf": csrf}).status_code == 303
    assert query(db_url, "SELECT chosen_id, rejected_id FROM preferences") == [(ids[0], ids[1])]
    cli = subprocess.run([str(RESERVOIR), "review", "prefer", str(ids[2]), str(ids[1])],
                         env=command_env(db_url), cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode == 1 and "one prompt" in cli.stderr


@pytest.mark.process
def test_a_multi_turn_episode_is_shown_as_turns(store, review_server, db_url, tmp_path):
    """A multi-turn episode was shown as raw template text; its environment's turns, which
    never train (action mask 0), are marked so."""
    from reservoir.models import build_tiny_model, load_model

    model = build_tiny_model(tmp_path / "tiny")
    tokenizer = load_model(model)[1]
    store.create_run("agent", model=str(model))
    turns = [("CALC 14+13<|end|>", 1), ("<|tool|>27<|end|><|assistant|>", 0), ("ANSWER 27", 1)]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text, _ in turns]
    group = make_group("agent", size=1, response_len=sum(map(len, ids)))
    group[0].response_ids = [i for part in ids for i in part]
    group[0].action_mask = [mask for (_, mask), part in zip(turns, ids) for _ in part]
    group[0].response_text = "".join(text for text, _ in turns)
    store.write_groups([group], status="raw")
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE experiences SET status = 'held'"))
        conn.execute(text("INSERT INTO reviews (experience_id, reason) SELECT id, 'look' "
                          "FROM experiences"))
    url, _ = review_server()
    page = httpx.get(f"{url}/", timeout=60).text
    shown = re.findall(r'<div class="turn (model|environment)">(?:<span[^>]*>[^<]*</span>)?'
                       r"<pre>([^<]*)</pre>", page)
    assert [(kind, html.unescape(text)) for kind, text in shown] == [
        ("model", "CALC 14+13"), ("environment", "27"), ("model", "ANSWER 27")]
    assert "tool · not trained" in page


EVIL_PAGE = """<!doctype html><html><body>
<iframe name="sink1"></iframe><iframe name="sink2"></iframe>
<form id="review" method="post" action="{review}/reviews/1" target="sink1">
<input name="action" value="accept"><input name="csrf" value="guess"></form>
<form id="prefer" method="post" action="{review}/prefer" target="sink2">
<input name="chosen" value="{chosen}"><input name="rejected" value="{rejected}">
<input name="csrf" value="guess"></form>
<script>
const chat = JSON.stringify({{model: "agent", messages: [{{role: "user", content: "hi"}}],
                              user: "from-a-page"}});
const feedback = JSON.stringify({{episode_id: "from-a-page", reward: 1}});
async function attack() {{
  const tries = [
    fetch("{serve}/v1/chat/completions", {{method: "POST", mode: "no-cors", body: chat,
                                           headers: {{"Content-Type": "text/plain"}}}}),
    fetch("{serve}/v1/feedback", {{method: "POST", mode: "no-cors", body: feedback}}),
    fetch("{serve}/v1/chat/completions", {{method: "POST", body: chat,
                                           headers: {{"Content-Type": "application/json"}}}}),
  ];
  for (const tried of tries) {{ try {{ await tried; }} catch (e) {{}} }}
  let loaded = 0;
  for (const frame of document.querySelectorAll("iframe")) {{
    frame.onload = () => {{ if (++loaded === 2) document.title = "sent"; }};
  }}
  document.getElementById("review").submit();
  document.getElementById("prefer").submit();
}}
attack();
</script></body></html>"""


@pytest.mark.process
@pytest.mark.browser
def test_a_page_of_another_origin_drives_neither_server(held, review_server, served, browser,
                                                        db_url, tmp_path):
    """Issue 28: a page on another origin (here a second local port) posted text/plain to
    `reservoir serve` and was answered and recorded; it drives neither that server nor the
    review page, even in a browser logged in to the review page."""
    import functools
    import http.server
    import threading

    from tests.test_serve import counts, publish_start, published

    base = served.up(served())
    publish_start(db_url, served.config)
    wait_for(lambda: published(base, 0), timeout=30)
    review_url, _ = review_server()
    first, second = query(db_url, "SELECT id FROM experiences WHERE group_id = (SELECT group_id "
                                  "FROM experiences WHERE status = 'ready' LIMIT 1) ORDER BY id "
                                  "LIMIT 2")
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text(EVIL_PAGE.format(serve=base[:-3], review=review_url,
                                                      chosen=first[0], rejected=second[0]))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    other = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    before = (counts(db_url), query(db_url, "SELECT array_agg(status ORDER BY id) FROM reviews"))
    try:
        page = browser.new_page()
        page.goto(review_url + "/login")  # the person is logged in to the review page
        page.fill("input[name=reviewer]", "ana")
        page.fill("input[name=token]", TOKEN)
        page.click("button:has-text('log in')")
        page.goto(f"http://127.0.0.1:{other.server_address[1]}/index.html")
        page.wait_for_function("document.title === 'sent'", timeout=30_000)
    finally:
        other.shutdown()
    assert (counts(db_url), query(db_url, "SELECT array_agg(status ORDER BY id) FROM reviews")
            ) == before  # no episode, call or experience; no review decided
    assert query(db_url, "SELECT count(*) FROM preferences") == [(0,)]
    assert query(db_url, "SELECT count(*) FROM review_actions") == [(0,)]
