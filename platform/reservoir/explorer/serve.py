"""`reservoir serve`: an OpenAI-compatible endpoint on the run's latest policy that records
every call as experience.

    POST /v1/chat/completions   sample with the policy; every response is recorded in its
                                episode (X-Episode-Id header, else the `user` field, else the
                                call's own id), with token ids, logprobs and policy version;
                                the episode's first call returns X-Episode-Secret, which its
                                later calls and its report must carry
    GET  /v1/models             the one model served (serve.model_name, else the run's name)
    POST /v1/feedback           {episode_id, episode_secret, reward | rewards}: the episode's
                                responses become one group of experiences (raw or ready);
                                before, none trains
    GET  /health                the run and the policy version served
    GET  /metrics               Prometheus: requests, latencies, errors by kind, tokens,
                                responses recorded, episodes reported, the version served

No web page can drive it (reservoir.http.Guard): a request's Host must be an address served,
its Origin absent or the server's own, a POST's body application/json and at most
serve.max_request_bytes; JSON numbers past float64, NaN and deep nesting are 400s.

Weights follow the trainer: a NOTIFY on the policy channel (or the poll) makes the server load
the run's latest version in place, between two batches; before the trainer has published the
run's first version (version 0, when its first explorer stage begins) calls get 503, as an
explorer waits for it. Concurrent calls are batched (the
explorer's `Batcher`). Bound to 127.0.0.1 unless serve.host says otherwise; any other address
needs the bearer token in the environment variable serve.token_env, and once a token is set
every request must carry it. Errors come as OpenAI's error objects with the status its clients
expect (400, 401, 404, 409), and a refused call stores nothing.
"""

from __future__ import annotations

import hmac
import os
import sys
import threading

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from reservoir.chat import prompt_ids, render
from reservoir.config import ReservoirConfig
from reservoir.errors import (ConfigError, EpisodeClosed, EpisodeForbidden, EpisodeUnknown,
                              ExperienceInvalid, FlowControlTimeout)
from reservoir.explorer.batcher import Batcher
from reservoir.http import Guard, is_loopback, loads, served_hosts
from reservoir.metrics.requests import MISSING, for_service
from reservoir.explorer.engine import Engine, Request, take_policy
from reservoir.explorer.engines import make_engine
from reservoir.explorer.openai_api import (ApiError, ChatRequest, Limits, bad, completion,
                                           completion_id, episode_of, episode_secret,
                                           finish_reason, parse_chat, parse_feedback, stream)
from reservoir.plan.streams import written_status
from reservoir.store import POLICY_CHANNEL, Call, Listener, Store, closing, is_outage, rewarded

RELOAD_POLL_S = 2.0  # look for a new policy this often even without a notification


def token_for(config: ReservoirConfig) -> str | None:
    """The bearer token from the environment; ConfigError when the address is not a loopback
    one and there is none."""
    serve = config.serve
    token = os.environ.get(serve.token_env) or None
    if token is None and not is_loopback(serve.host):
        raise ConfigError(f"serve.host: {serve.host} is reachable from other machines; set a "
                          f"bearer token in the environment variable {serve.token_env} first")
    return token


class Server:
    """The engine behind its batcher, the store, and the policy version being served."""

    def __init__(self, config: ReservoirConfig, engine: Engine | None = None) -> None:
        """`engine`: a colocated trainer's, on its own module: nothing is loaded, and the
        trainer sets the tag (the version) as it lets calls generate between its steps."""
        if config.serve is None:
            raise ConfigError("serve: the config has no serve section; add `serve: {}` (a "
                              "served run's groups are episodes of any size)")
        self.config, self.token = config, token_for(config)
        self.model = config.serve.model_name or config.run.name
        self.store = Store.open(config, quiet=True)
        self.run_id = self.store.run_id(config.run.name)
        self.batcher = Batcher(engine or make_engine(config, seed=config.run.seed))
        self.metrics = for_service("serve")
        self.reported = threading.Event()  # set by each episode reported
        self._stop = threading.Event()
        self._follower = None
        if engine is None:
            self.reload()  # the tag stays None (nothing served) until the trainer publishes
            self._follower = threading.Thread(target=self._follow, name="policy", daemon=True)
            self._follower.start()

    @property
    def version(self) -> int | None:
        """The policy version served; None before the trainer published the run's first."""
        return self.batcher.tag

    def reload(self) -> None:
        """Take the run's latest published policy if it is newer than the one served."""
        latest = self.store.runs.latest_policy(self.run_id)
        if latest is not None and latest[0] != self.batcher.tag:
            with self.batcher.exclusive() as engine:
                take_policy(engine, latest[1], self.config.model.path)
                self.batcher.tag = latest[0]

    def _follow(self) -> None:
        """Reload on every notification or poll; an outage or a bad weights file leaves the
        version served as it is (the latter said in one line), and the next poll tries again."""
        with Listener(self.store.engine, POLICY_CHANNEL) as listener:
            while not self._stop.is_set():
                listener.wait(RELOAD_POLL_S)
                try:
                    self.reload()
                except Exception as exc:
                    if not is_outage(exc):
                        print(f"warning: still serving policy version {self.version}: "
                              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def count(self, name: str, amount: float, *labels: str) -> None:
        if self.metrics is not None:
            self.metrics.count(name, amount, *labels)

    def check_token(self, header: str | None) -> None:
        if self.token is None:
            return
        given = (header or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise ApiError(401, "Incorrect API key provided: pass the server's bearer token "
                                "(Authorization: Bearer ...)", code="invalid_api_key")

    def chat(self, body, episode_header: str | None,
             secret_header: str | None) -> tuple[dict, str, str | None, ChatRequest]:
        """(the completion, its episode, the secret made when this call opened it, the
        request); the responses are recorded."""
        explorer, serve = self.config.explorer, self.config.serve
        request = parse_chat(body, model=self.model, temperature=explorer.temperature,
                             limits=Limits(serve.max_n, serve.max_messages, serve.max_tools))
        secret = episode_secret(secret_header, "X-Episode-Secret")
        if self.version is None:
            raise ApiError(503, f"run {self.config.run.name!r} has no published policy yet: the "
                                "trainer publishes version 0 when its first explorer stage "
                                "begins (start `reservoir train`)", type="server_error",
                           code="no_policy")
        episode = episode_of(episode_header, request)
        if episode is not None:  # refused before the model works for it
            self.store.episodes.check_caller(self.run_id, episode, secret)
        tokenizer = self.batcher.engine.tokenizer
        try:
            ids = prompt_ids(tokenizer, request.messages, tools=request.tools)
        except Exception as exc:  # the model's template refuses this conversation
            raise bad("messages", f"the model's chat template cannot render them: {exc}")
        room = self.batcher.engine.context - len(ids)
        max_tokens = request.max_tokens or min(serve.max_tokens, room)
        if room < 1 or max_tokens > room:
            raise bad("messages", f"{len(ids)} prompt tokens and max_tokens {max_tokens} exceed "
                                  f"the model's context of {self.batcher.engine.context}",
                      code="context_length_exceeded")
        (samples,), version = self.batcher.generate_tagged(
            [Request(ids, request.n, request.temperature, max_tokens)])
        call_id = completion_id()
        episode = episode or call_id
        response = completion(call_id, self.model, version, request, tokenizer, samples)
        prompt = render(tokenizer, request.messages, generation_prompt=True, tools=request.tools)
        calls = [Call(call_id, index, version, request.temperature, prompt, sample.raw_text,
                      sample.prompt_ids, sample.response_ids, sample.logprobs,
                      finish_reason(sample)) for index, sample in enumerate(samples)]
        # the last thing: a failure above stores nothing
        _, made = self.store.episodes.record_calls(self.run_id, episode, calls, secret=secret)
        self.count("recorded", len(calls))
        self.count("tokens", len(samples[0].prompt_ids), "prompt")
        self.count("tokens", sum(len(sample.response_ids) for sample in samples), "completion")
        return response, episode, made, request

    def feedback(self, body, secret_header: str | None) -> dict:
        """The episode's responses, rewarded, written as one group; it takes no more calls."""
        given = parse_feedback(body, self.config.explorer.reward_range, secret_header)
        episode = self.store.episodes.open_episode(self.config.run.name, self.run_id,
                                                   given.episode, given.secret)
        n = len(episode.group)
        rewards = given.rewards or [given.reward] * n
        if len(rewards) != n:
            raise bad("rewards", f"episode {given.episode!r} has {n} responses; got "
                                 f"{len(rewards)} rewards")
        components = [given.components] * n if given.components else None
        status = written_status(self.config.pipelines)
        written = self.store.write_groups([rewarded(episode.group, rewards, components)],
                                          status=status, before_copy=closing(episode, given.reward))
        self.count("reported", 1)
        self.reported.set()
        return {"episode_id": given.episode, "responses": written.rows, "status": status,
                "group_id": str(written.group_ids[0]), "policy_version":
                episode.group[0].policy_version}

    def close(self) -> None:
        self._stop.set()
        if self._follower is not None:
            self._follower.join(RELOAD_POLL_S + 5)
        self.batcher.close()
        self.store.close()


STATUS = {EpisodeUnknown: 404, EpisodeForbidden: 403, EpisodeClosed: 409,
          ExperienceInvalid: 400, FlowControlTimeout: 429}


def create_app(server: Server) -> Guard:
    """The API behind its guard (reservoir.http.Guard), for the address it is served on."""
    serve = server.config.serve
    hosts = served_hosts(serve.host, serve.port, serve.allowed_hosts)
    api = _api(server)
    return Guard(api if server.metrics is None else server.metrics.wrap(api), hosts=hosts,
                 json_posts=True, max_body=serve.max_request_bytes,
                 refuse=lambda status, message: JSONResponse(ApiError(status, message).body(),
                                                             status_code=status))


def _api(server: Server) -> FastAPI:
    app = FastAPI(title="Reservoir", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    for kind, status in STATUS.items():
        app.add_exception_handler(kind, lambda request, exc, status=status: JSONResponse(
            ApiError(status, str(exc)).body(), status_code=status))

    def authorised(request: HttpRequest) -> None:
        server.check_token(request.headers.get("authorization"))

    async def body_of(request: HttpRequest):
        limit, body = server.config.serve.max_request_bytes, bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is larger than {limit:,} bytes (the "
                                    "server's limit)")
        try:
            return loads(bytes(body))
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    @app.get("/v1/models")
    def models(request: HttpRequest) -> dict:
        authorised(request)
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": 0,
                                            "owned_by": "reservoir"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        authorised(request)
        body = await body_of(request)
        response, episode, secret, asked = await _outage_is_503(
            server.chat, body, request.headers.get("x-episode-id"),
            request.headers.get("x-episode-secret"))
        headers = {"X-Episode-Id": episode, "X-Reservoir-Policy-Version":
                   response["system_fingerprint"].removeprefix("reservoir-v")}
        if secret is not None:
            headers["X-Episode-Secret"] = secret
        if asked.stream:
            return StreamingResponse(stream(response, asked.usage_in_stream),
                                     media_type="text/event-stream", headers=headers)
        return JSONResponse(response, headers=headers)

    @app.post("/v1/feedback")
    async def feedback(request: HttpRequest) -> dict:
        authorised(request)
        return await _outage_is_503(server.feedback, await body_of(request),
                                    request.headers.get("x-episode-secret"))

    @app.get("/health")
    def health() -> dict:
        return {"run": server.config.run.name, "model": server.model,
                "policy_version": server.version}

    @app.get("/metrics")
    def metrics(request: HttpRequest) -> Response:
        authorised(request)
        if server.metrics is None:
            return PlainTextResponse(MISSING, status_code=501)
        body, kind = server.metrics.exposition()
        return Response(body, media_type=kind)

    return app


async def _outage_is_503(function, *args):
    """`function(*args)` in a worker thread; the store being unreachable (a restart) is a 503
    the client retries, with nothing of the call stored."""
    try:
        return await run_in_threadpool(function, *args)
    except Exception as exc:
        if isinstance(exc, ApiError) or not is_outage(exc):
            raise
        raise ApiError(503, "the experience store is unreachable (restarting?); nothing was "
                            "recorded, try again", type="server_error") from None
