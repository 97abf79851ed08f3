"""`reservoir review serve`: a page to review held rows and choose between two responses.

Server-rendered HTML (Jinja2, autoescaped; no build step, no script). Pages:

    /          pending reviews (rows a pipeline held): accept, reject, or label each
    /compare   two different responses to one task: pick the better (a preference pair that a
               DPO stage trains on) or skip
    /actions   the latest review actions: who did what, when, on which rows
    /login     reviewer name and token: a signed, HttpOnly, SameSite=Strict cookie

Writing needs the token (RESERVOIR_REVIEW_TOKEN, or one made for this server and printed at
start); every form carries a CSRF token tied to the session. Bound to 127.0.0.1 the pages can
be read without logging in; bound elsewhere, reading needs the login too. Each action and its
`review_actions` row commit in one transaction (reservoir.store.reviews).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import DictLoader, Environment

from reservoir.errors import ReservoirError
from reservoir.pipeline.review_templates import TEMPLATES
from reservoir.store import Store
from reservoir.store.reviews import label, next_pair, pending, prefer, recent_actions, set_label

COOKIE = "reservoir_review"
REVIEWER = re.compile(r"[\w.@ -]{1,100}")
PAGE_SIZE = 50


class Reviewing:
    """The store, the token, and how sessions are signed."""

    def __init__(self, store: Store, token: str, *, run: str | None, open_reading: bool):
        self.store, self.token, self.run, self.open_reading = store, token, run, open_reading
        self._key = hashlib.sha256(secrets.token_bytes(32) + token.encode()).digest()
        self.templates = Environment(loader=DictLoader(TEMPLATES), autoescape=True)
        self.templates.globals["run"] = run

    def _sign(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def cookie_for(self, reviewer: str) -> str:
        name = base64.urlsafe_b64encode(reviewer.encode()).decode()
        return f"{name}.{self._sign('session:' + reviewer)}"

    def reviewer_of(self, request: Request) -> str | None:
        name, _, signature = (request.cookies.get(COOKIE) or "").partition(".")
        try:
            reviewer = base64.urlsafe_b64decode(name.encode()).decode()
        except (ValueError, UnicodeDecodeError):
            return None
        return reviewer if signature and hmac.compare_digest(
            signature, self._sign("session:" + reviewer)) else None

    def csrf(self, reviewer: str) -> str:
        return self._sign("csrf:" + reviewer)

    def page(self, name: str, request: Request, status: int = 200, **values) -> HTMLResponse:
        reviewer = self.reviewer_of(request)
        html = self.templates.get_template(name).render(
            reviewer=reviewer, csrf=self.csrf(reviewer) if reviewer else "",
            done=request.query_params.get("done"), **values)
        return HTMLResponse(html, status_code=status)


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def create_app(reviewing: Reviewing) -> FastAPI:
    app = FastAPI(title="Reservoir review", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.reviewing = reviewing

    @app.exception_handler(Refused)
    def refused(request: Request, exc: Refused) -> HTMLResponse:
        return reviewing.page("error", request, exc.status, message=str(exc))

    def can_read(request: Request) -> None:
        if not reviewing.open_reading and reviewing.reviewer_of(request) is None:
            raise Refused(401, "log in to read the reviews (this server is not on loopback)")

    def writer(request: Request, csrf: str) -> str:
        reviewer = reviewing.reviewer_of(request)
        if reviewer is None:
            raise Refused(401, "log in with the review token first")
        if not hmac.compare_digest(csrf, reviewing.csrf(reviewer)):
            raise Refused(403, "the form's token does not match your session; reload the page")
        return reviewer

    def act(action) -> None:
        try:
            with reviewing.store.engine.begin() as conn:
                action(conn)
        except ReservoirError as exc:
            raise Refused(409, str(exc)) from None

    @app.get("/", response_class=HTMLResponse)
    def reviews(request: Request) -> HTMLResponse:
        can_read(request)
        with reviewing.store.engine.connect() as conn:
            rows = pending(conn, reviewing.run, PAGE_SIZE)
        return reviewing.page("reviews", request, rows=rows)

    @app.post("/reviews/{review_id}")
    def review(request: Request, review_id: int, action: str = Form(...),
               note: str = Form(""), tags: str = Form(""), csrf: str = Form("")) -> Response:
        reviewer = writer(request, csrf)
        values = labels(note, tags)
        if action == "label":
            act(lambda conn: set_label(conn, review_id, reviewer=reviewer, values=values))
        elif action in ("accept", "reject"):
            act(lambda conn: label(conn, review_id, verdict=action, reviewer=reviewer,
                                   values=values, source="web"))
        else:
            raise Refused(400, f"action {action[:20]!r}: accept, reject or label")
        return RedirectResponse(f"/?done={action}+{review_id}", status_code=303)

    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request, after: int = 0) -> HTMLResponse:
        can_read(request)
        with reviewing.store.engine.connect() as conn:
            pair = next_pair(conn, reviewing.run, after)
        return reviewing.page("compare", request, pair=pair, after=after)

    @app.post("/prefer")
    def choose(request: Request, chosen: int = Form(...), rejected: int = Form(...),
               after: int = Form(0), csrf: str = Form("")) -> Response:
        reviewer = writer(request, csrf)
        act(lambda conn: prefer(conn, chosen, rejected, reviewer=reviewer, source="web"))
        return RedirectResponse(f"/compare?after={after}&done=prefer+{chosen}", status_code=303)

    @app.get("/actions", response_class=HTMLResponse)
    def actions(request: Request) -> HTMLResponse:
        can_read(request)
        with reviewing.store.engine.connect() as conn:
            rows = recent_actions(conn, 100)
        return reviewing.page("actions", request, rows=rows)

    @app.get("/login", response_class=HTMLResponse)
    def login_page(request: Request, token: str = "") -> HTMLResponse:
        return reviewing.page("login", request, token=token[:200])

    @app.post("/login")
    def login(reviewer: str = Form(...), token: str = Form(...)) -> Response:
        reviewer = reviewer.strip()
        if not REVIEWER.fullmatch(reviewer):
            raise Refused(400, "a reviewer name is 1 to 100 letters, digits, spaces or . @ _ -")
        if not hmac.compare_digest(token.encode(), reviewing.token.encode()):
            raise Refused(401, "wrong token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, reviewing.cookie_for(reviewer), httponly=True,
                            samesite="strict")
        return response

    @app.post("/logout")
    def logout() -> Response:
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE)
        return response

    return app


def labels(note: str, tags: str) -> dict:
    """A review's labels from the form: a note and comma-separated tags."""
    if len(note) > 10_000 or len(tags) > 1_000 or "\x00" in note + tags:
        raise Refused(400, "a note is at most 10,000 characters and tags 1,000, without NUL")
    found = [tag.strip() for tag in tags.split(",") if tag.strip()]
    return {key: value for key, value in (("note", note.strip()), ("tags", found)) if value}
