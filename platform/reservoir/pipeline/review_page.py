"""`reservoir review serve`: a page to review held rows and choose between two responses.

Server-rendered HTML (Jinja2, autoescaped; no build step, no script). Pages:

    /          pending reviews (rows a pipeline held): accept, reject, or label each
    /compare   two different responses to one prompt (one group): pick the better (a
               preference pair that a DPO stage trains on) or skip
    /actions   the latest review actions: who did what, when, on which rows
    /login     reviewer name and token (POST only): a session on the server, its id in an
               HttpOnly, SameSite=Strict cookie that expires; logging out ends it
    /metrics   Prometheus: requests, latencies, errors by kind, actions recorded, failed
               logins (bound elsewhere than loopback: the review token as a bearer token)

Writing needs the token (RESERVOIR_REVIEW_TOKEN, at least 16 characters, 8 of them different;
else one made for this server and printed apart from its address); every form carries a CSRF
token tied to the session. Five failed logins from one address within a minute lock it out for
the rest of the minute, and every failure is answered slowly. Bound to 127.0.0.1 the pages can
be read without logging in; bound elsewhere, reading needs the login too. Started for one run
(--run), it shows and changes that run's rows only. No page of another site gets past
reservoir.http.Guard (Host, Origin). A multi-turn response is shown turn by turn, the
environment's turns (action mask 0) marked as not trained. Each action and its
`review_actions` row commit in one transaction (reservoir.store.reviews).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import time
from collections import deque
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from jinja2 import DictLoader, Environment
from tokenizers import Tokenizer

from reservoir.errors import ConfigError, ReservoirError, RowUnknown
from reservoir.http import Guard, served_hosts
from reservoir.metrics.requests import MISSING, for_service
from reservoir.pipeline.review_templates import TEMPLATES
from reservoir.store import MASK, TOKEN, Store, decode

COOKIE = "reservoir_review"
REVIEWER = re.compile(r"[\w.@ -]{1,100}")
PAGE_SIZE = 50
SESSION_SECONDS = 12 * 3600       # a login lasts this long (or until it logs out)
FAILED_LOGINS, LOCKOUT_S = 5, 60  # failures from one address within LOCKOUT_S lock it out
FAILURE_DELAY_S = 0.5             # every failed login is answered this late
MAX_FORM_BYTES = 64 * 1024


def review_token(given: str | None, name: str) -> str:
    """The token from the environment variable `name`, refused unless it is at least 16
    characters, 8 of them different; a new random one when none is given."""
    if given is None:
        return secrets.token_urlsafe(24)
    if len(given) < 16 or len(set(given)) < 8:
        raise ConfigError(f"{name}: a token is at least 16 characters, 8 of them different "
                          "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))'); "
                          "unset it and the server makes one")
    return given


class Reviewing:
    """The store, the token, the sessions and the record of failed logins."""

    def __init__(self, store: Store, token: str, *, run: str | None, open_reading: bool):
        self.store, self.token, self.run, self.open_reading = store, token, run, open_reading
        self._key = secrets.token_bytes(32)
        self.sessions: dict[str, tuple[str, float]] = {}   # id: (reviewer, expires at)
        self.failures: dict[str, deque] = {}                # address: times of failed logins
        self.templates = Environment(loader=DictLoader(TEMPLATES), autoescape=True)
        self.templates.globals["run"] = run
        self.metrics = for_service("review")

    def count(self, counter: str, *labels: str) -> None:
        if self.metrics is not None:
            self.metrics.count(counter, 1, *labels)

    def open_session(self, reviewer: str) -> str:
        session = secrets.token_urlsafe(32)
        self.sessions[session] = (reviewer, time.time() + SESSION_SECONDS)
        return session

    def reviewer_of(self, request: Request) -> str | None:
        found = self.sessions.get(request.cookies.get(COOKIE) or "")
        if found is None or found[1] < time.time():
            return None
        return found[0]

    def csrf(self, request: Request) -> str:
        session = request.cookies.get(COOKIE) or ""
        return hmac.new(self._key, b"csrf:" + session.encode(), hashlib.sha256).hexdigest()

    def locked_out(self, address: str) -> float:
        """Seconds left of the address's lockout (0: none), its old failures forgotten."""
        times = self.failures.setdefault(address, deque())
        while times and times[0] < time.monotonic() - LOCKOUT_S:
            times.popleft()
        return LOCKOUT_S - (time.monotonic() - times[0]) if len(times) >= FAILED_LOGINS else 0.0

    def page(self, name: str, request: Request, status: int = 200, **values) -> HTMLResponse:
        reviewer = self.reviewer_of(request)
        html = self.templates.get_template(name).render(
            reviewer=reviewer, csrf=self.csrf(request) if reviewer else "",
            done=request.query_params.get("done"), **values)
        return HTMLResponse(html, status_code=status)


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@lru_cache(maxsize=8)
def _tokenizer(model: str):
    """The tokenizer of a run's model folder (None when it cannot be read here): its
    tokenizer.json through `tokenizers` (no torch import in a page's request), else
    transformers' AutoTokenizer."""
    try:
        if (Path(model) / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:
        return None


ROLE_TOKEN = re.compile(r"<\|(\w+)\|>")
# markers of a chat template that name no speaker (an environment turn ends with the template's
# prompt for the model's next turn, `assistant`)
NOT_ROLES = ("end", "pad", "unk", "endoftext", "im_end", "im_start", "eot_id", "assistant")


def with_turns(row: dict) -> dict:
    """The row with `turns`: [(model | environment, role, text)] of a response the
    environment took part in (its action mask has zeros), split by the mask and decoded with
    the run's tokenizer (its special tokens name an environment turn's role: tool, user ...);
    else None."""
    mask = decode(row.get("action_mask"), MASK) if row.get("action_mask") else None
    tokenizer = _tokenizer(row["model"]) if mask is not None and not mask.all() and \
        row.get("model") else None
    if tokenizer is None:
        return {**row, "turns": None}
    ids, turns, start = decode(row["response_ids"], TOKEN).tolist(), [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
            roles = [name for name in ROLE_TOKEN.findall(text) if name not in NOT_ROLES]
            kind = "model" if mask[start] else "environment"
            role = "model" if mask[start] else (roles[0] if roles else "environment")
            turns.append((kind, role, ROLE_TOKEN.sub("", text).strip()))
            start = end
    return {**row, "turns": turns}


def create_app(reviewing: Reviewing, host: str, port: int) -> Guard:
    """The pages behind reservoir.http.Guard, for the address they are served on."""
    pages = _pages(reviewing)
    return Guard(pages if reviewing.metrics is None else reviewing.metrics.wrap(pages),
                 hosts=served_hosts(host, port), json_posts=False,
                 max_body=MAX_FORM_BYTES,
                 refuse=lambda status, message: PlainTextResponse(message, status_code=status))


def _pages(reviewing: Reviewing) -> FastAPI:
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
        if not hmac.compare_digest(csrf, reviewing.csrf(request)):
            raise Refused(403, "the form's token does not match your session; reload the page")
        return reviewer

    def act(name: str, action) -> None:
        try:
            action()
            reviewing.count("actions", name)
        except RowUnknown as exc:
            raise Refused(404, str(exc)) from None
        except ReservoirError as exc:
            raise Refused(409, str(exc)) from None

    @app.get("/", response_class=HTMLResponse)
    def reviews(request: Request) -> HTMLResponse:
        can_read(request)
        rows = reviewing.store.reviews.pending(reviewing.run, PAGE_SIZE)
        return reviewing.page("reviews", request, rows=[with_turns(row) for row in rows])

    @app.post("/reviews/{review_id}")
    def review(request: Request, review_id: int, action: str = Form(...),
               note: str = Form(""), tags: str = Form(""), csrf: str = Form("")) -> Response:
        reviewer = writer(request, csrf)
        values = labels(note, tags)
        if action == "label":
            act(action, lambda: reviewing.store.reviews.set_label(
                review_id, reviewer=reviewer, values=values, run=reviewing.run))
        elif action in ("accept", "reject"):
            act(action, lambda: reviewing.store.reviews.label(
                review_id, verdict=action, reviewer=reviewer, values=values, source="web",
                run=reviewing.run))
        else:
            raise Refused(400, f"action {action[:20]!r}: accept, reject or label")
        return RedirectResponse(f"/?done={action}+{review_id}", status_code=303)

    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request, after: int = 0) -> HTMLResponse:
        can_read(request)
        pair = reviewing.store.reviews.next_pair(reviewing.run, after)
        return reviewing.page("compare", request, pair=[with_turns(row) for row in pair],
                              after=after)

    @app.post("/prefer")
    def choose(request: Request, chosen: int = Form(...), rejected: int = Form(...),
               after: int = Form(0), csrf: str = Form("")) -> Response:
        reviewer = writer(request, csrf)
        act("prefer", lambda: reviewing.store.reviews.prefer(
            chosen, rejected, reviewer=reviewer, source="web", run=reviewing.run))
        return RedirectResponse(f"/compare?after={after}&done=prefer+{chosen}", status_code=303)

    @app.get("/actions", response_class=HTMLResponse)
    def actions(request: Request) -> HTMLResponse:
        can_read(request)
        rows = reviewing.store.reviews.recent_actions(100)
        return reviewing.page("actions", request, rows=rows)

    @app.get("/login", response_class=HTMLResponse)
    def login_page(request: Request) -> HTMLResponse:
        return reviewing.page("login", request)

    @app.post("/login")
    async def login(request: Request, reviewer: str = Form(...),
                    token: str = Form(...)) -> Response:
        address = request.client.host if request.client else "?"
        wait = reviewing.locked_out(address)
        if wait:
            reviewing.count("failed_logins")
            raise Refused(429, f"too many failed logins from {address}: try again in "
                               f"{wait:.0f} s")
        reviewer = reviewer.strip()
        if not REVIEWER.fullmatch(reviewer):
            raise Refused(400, "a reviewer name is 1 to 100 letters, digits, spaces or . @ _ -")
        if not hmac.compare_digest(token.encode(), reviewing.token.encode()):
            reviewing.failures[address].append(time.monotonic())
            reviewing.count("failed_logins")
            await asyncio.sleep(FAILURE_DELAY_S)
            raise Refused(401, "wrong token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, reviewing.open_session(reviewer), max_age=SESSION_SECONDS,
                            httponly=True, samesite="strict")
        return response

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        if not reviewing.open_reading:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), reviewing.token.encode()):
                return PlainTextResponse("pass the review token: Authorization: Bearer TOKEN",
                                         status_code=401)
        if reviewing.metrics is None:
            return PlainTextResponse(MISSING, status_code=501)
        body, kind = reviewing.metrics.exposition()
        return Response(body, media_type=kind)

    @app.post("/logout")
    def logout(request: Request) -> Response:
        reviewing.sessions.pop(request.cookies.get(COOKIE) or "", None)
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
