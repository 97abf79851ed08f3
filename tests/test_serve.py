"""`reservoir serve` as a real process, driven by the official `openai` client: chat
completions are recorded per episode, a reported reward turns an episode into one group of
experiences (ids, logprobs, mask, reward) that a trainer consumes, the server then serves the
trainer's new version, and bad requests get the errors OpenAI clients expect with nothing
stored."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import httpx
import numpy as np
import openai
import pytest
import torch

from reservoir.agent import Episode, report_reward
from reservoir.config import load_config
from reservoir.errors import ReservoirError
from reservoir.models import build_tiny_model
from reservoir.store import Store, codec
from tests.test_recovery import RESERVOIR, finish, query, start, wait_for, write_config
from tests.test_restart import own_server  # noqa: F401 (a fixture)
from tests.test_run import ledger

pytestmark = pytest.mark.slow


USER = [{"role": "user", "content": "Reverse: abc"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def served(tmp_path, db_url):
    """A config for a served run, and a function starting `reservoir serve` on it."""
    port = free_port()
    config = write_config(tmp_path / "agent.yaml", {
        "run": {"name": "agent"}, "model": {"path": str(build_tiny_model(tmp_path / "tiny"))},
        "tasks": {"generate": None}, "serve": {"port": port, "max_tokens": 8},
        "trainer": {"algorithm": "grpo", "steps": 1, "batch_groups": 2, "micro_batch": 8,
                    "eval_interval": 100, "checkpoint_dir": str(tmp_path / "checkpoints")},
        "store": {"url": db_url}})
    processes = []

    def serve(*args: str, token: str | None = None):
        env_token = {"RESERVOIR_SERVE_TOKEN": token} if token else {}
        os.environ.update(env_token)
        try:
            process = start("serve", str(config), *args, cwd=tmp_path)
        finally:
            for name in env_token:
                del os.environ[name]
        processes.append(process)
        return process

    def up(process) -> str:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: process.poll() is not None or responds(f"{url}/health"), timeout=120)
        assert process.poll() is None, process.stdout.read()
        return f"{url}/v1"

    serve.config, serve.up, serve.port = config, up, port
    yield serve
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            process.communicate(timeout=60)


def responds(url: str) -> bool:
    """Whether a GET of the URL answers 200 (the server is up)."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def counts(db_url) -> tuple:
    return query(db_url, "SELECT (SELECT count(*) FROM episodes), (SELECT count(*) FROM "
                         "episode_calls), (SELECT count(*) FROM experiences)")[0]


def published(base: str, version: int) -> bool:
    return httpx.get(f"{base[:-3]}/health").json()["policy_version"] == version


def publish_start(db_url: str, config) -> None:
    """Version 0 as the trainer would publish it (the model folder's weights, at step 0)."""
    with Store(db_url) as store:
        store.publish_version("agent", 0, location=str(load_config(config).model.path),
                              train_step=0)


def test_calls_are_recorded_then_feedback_makes_them_experiences_that_train(served, db_url,
                                                                            tmp_path):
    base = served.up(served())
    trainer = start("train", str(served.config), cwd=tmp_path)  # it publishes version 0
    wait_for(lambda: published(base, 0), timeout=120)
    client = openai.OpenAI(base_url=base, api_key="unused")
    assert [model.id for model in client.models.list()] == ["agent"]
    first = client.chat.completions.with_raw_response.create(
        model="agent", messages=USER, n=2, logprobs=True, user="episode-a")
    secret = first.headers["x-episode-secret"]  # the episode is this client's from now on
    first = first.parse()
    second = client.chat.completions.with_raw_response.create(
        model="agent", messages=USER + [{"role": "assistant", "content": "cba"},
                                        {"role": "user", "content": "again"}],
        max_tokens=4, extra_headers={"X-Episode-Id": "episode-a", "X-Episode-Secret": secret})
    assert second.headers["x-episode-id"] == "episode-a"
    assert "x-episode-secret" not in second.headers  # made once, by the call that opened it
    assert len(first.choices) == 2 and first.usage.completion_tokens > 0
    assert counts(db_url) == (1, 3, 0)  # recorded, and nothing trains before the reward
    answer = report_reward(base, "episode-a", rewards=[1.0, 0.0, 0.5], secret=secret)
    assert (answer["responses"], answer["status"]) == (3, "ready")
    assert counts(db_url) == (1, 0, 3)
    rows = query(db_url, "SELECT group_id, group_row, reward, response_ids, logprobs, "
                         "action_mask, policy_version, metadata FROM experiences ORDER BY id")
    assert len({row.group_id for row in rows}) == 1 and [r.reward for r in rows] == [1, 0, 0.5]
    for row, choice in zip(rows, first.choices):  # the very tokens and logprobs it was sent
        sent = [token.logprob for token in choice.logprobs.content]
        np.testing.assert_allclose(codec.decode(row.logprobs, codec.LOGPROB), sent, rtol=1e-6)
        assert len(codec.decode(row.response_ids, codec.TOKEN)) == len(sent)
        assert codec.decode(row.action_mask, codec.MASK).tolist() == [1] * len(sent)
        assert row.metadata["call"] == first.id and row.metadata["episode"] == "episode-a"
    assert {row.policy_version for row in rows} == {0}
    with pytest.raises(openai.ConflictError):  # a reported episode takes no more calls
        client.chat.completions.create(model="agent", messages=USER, user="episode-a",
                                       extra_headers={"X-Episode-Secret": secret})
    with pytest.raises(ReservoirError, match="HTTP 409: episode 'episode-a': its reward was "
                                             "reported already"):
        report_reward(base, "episode-a", 1.0, secret=secret)
    episode_b = Episode(client, "episode-b")
    episode_b.create(model="agent", messages=USER, n=2)
    episode_b.report(rewards=[0.0, 1.0])
    assert "policy version 1" in finish(trainer, timeout=240)  # it leased both episodes
    trained = query(db_url, "SELECT count(*) FROM batch_items b JOIN train_steps t ON "
                            "t.id = b.train_step_id WHERE t.step = 1")[0][0]
    assert trained == 5 and query(db_url, "SELECT DISTINCT status FROM experiences") == [
        ("consumed",)]
    wait_for(lambda: published(base, 1), timeout=30)
    client.chat.completions.create(model="agent", messages=USER, user="episode-c")
    assert query(db_url, "SELECT policy_version FROM episode_calls") == [(1,)]
    # its /metrics, read by prometheus_client, as the store has it
    from tests.test_metrics import scrape

    got = scrape(f"{base[:-3]}/metrics")
    stored = query(db_url, "SELECT (SELECT count(*) FROM experiences) + (SELECT count(*) FROM "
                           "episode_calls), (SELECT count(*) FROM episodes WHERE group_id IS "
                           "NOT NULL)")[0]
    assert got[("reservoir_serve_responses_recorded_total",)] == stored[0] == 6
    assert got[("reservoir_serve_episodes_reported_total",)] == stored[1] == 2
    assert got[("reservoir_serve_tokens_total", ("kind", "completion"))] > 0
    completions = ("reservoir_http_requests_total", ("method", "POST"),
                   ("route", "/v1/chat/completions"))
    assert got[(*completions, ("status", "200"))] == 4
    assert got[(*completions, ("status", "409"))] == 3  # the openai client tried 3 times
    assert got[("reservoir_http_errors_total", ("kind", "409"))] == 4  # and the feedback's
    assert got[("reservoir_http_request_duration_seconds_count",
                ("route", "/v1/chat/completions"))] == 7


def test_bad_requests_get_openai_errors_and_store_nothing(served, db_url):
    base = served.up(served())
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="no published policy yet"):
        client.chat.completions.create(model="agent", messages=USER)  # (503: clients retry)
    publish_start(db_url, served.config)
    wait_for(lambda: published(base, 0), timeout=30)
    refused = [
        (openai.NotFoundError, dict(model="gpt-4o", messages=USER)),
        (openai.BadRequestError, dict(model="agent", messages=[])),
        (openai.BadRequestError, dict(model="agent", messages=[{"role": "robot",
                                                                "content": "hi"}])),
        (openai.BadRequestError, dict(model="agent", messages=USER, temperature=0.3)),
        (openai.BadRequestError, dict(model="agent", messages=USER, n=1000)),
        (openai.BadRequestError, dict(model="agent", messages=USER, max_tokens=10**6)),
        (openai.BadRequestError, dict(model="agent", messages=USER, stop=["\n"])),
        (openai.BadRequestError, dict(model="agent", messages=USER, user="two words")),
        (openai.BadRequestError, dict(model="agent", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
        (openai.BadRequestError, dict(model="agent", messages=[{"role": "user",
                                                                "content": "a\x00b"}])),
    ]
    for error, request in refused:
        with pytest.raises(error):
            client.chat.completions.create(**request)
    for body in (b"{not json", b"[1, 2]", b'{"model": "agent"}'):
        response = httpx.post(f"{base}/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and "message" in response.json()["error"]
    for feedback, status in (({"episode_id": "nobody", "reward": 1}, 404),
                             ({"episode_id": "x", "reward": float("inf")}, 400),
                             ({"episode_id": "x", "reward": True}, 400),
                             ({"episode_id": "x"}, 400),
                             ({"episode_id": "x", "reward": 1, "extra": 1}, 400)):
        response = httpx.post(f"{base}/feedback", content=_json(feedback),
                              headers={"content-type": "application/json"})
        assert response.status_code == status, (feedback, response.text)
    assert counts(db_url) == (0, 0, 0)
    short = Episode(client, "short")
    short.create(model="agent", messages=USER, n=2)
    with pytest.raises(ReservoirError, match="has 2 responses; got 3 rewards"):
        short.report(rewards=[1, 0, 1])
    assert counts(db_url) == (1, 2, 0)  # the refused report changed nothing


def _json(value) -> bytes:
    import json

    return json.dumps(value, allow_nan=True).encode()


def test_a_token_guards_the_server_and_is_required_off_loopback(served, db_url):
    refused = served("--host", "0.0.0.0")
    output, _ = refused.communicate(timeout=120)
    assert refused.returncode == 1
    assert output.strip().splitlines()[-1] == (
        "error: serve.host: 0.0.0.0 is reachable from other machines; set a bearer token in "
        "the environment variable RESERVOIR_SERVE_TOKEN first")
    base = served.up(served(token="s3cret-token"))
    taken = served()  # the same port again: one line, before any model is loaded
    assert taken.communicate(timeout=120)[0].strip().splitlines()[-1].startswith(
        f"error: serve.port: cannot listen on http://127.0.0.1:{served.port}: ")
    publish_start(db_url, served.config)
    wait_for(lambda: published(base, 0), timeout=30)
    for key in ("", "wrong"):
        client = openai.OpenAI(base_url=base, api_key=key or "missing", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="agent", messages=USER, user="guarded")
    assert httpx.post(f"{base}/feedback", json={"episode_id": "guarded", "reward": 1}
                      ).status_code == 401
    assert counts(db_url) == (0, 0, 0)
    guarded = Episode(openai.OpenAI(base_url=base, api_key="s3cret-token"), "guarded")
    guarded.create(model="agent", messages=USER)
    guarded.report(1.0)
    assert counts(db_url) == (1, 0, 1)


@pytest.mark.process
def test_a_database_outage_is_a_503_and_nothing_is_half_written(tmp_path, own_server):
    url, stop, start_again = own_server.url, own_server.stop, own_server.start
    port = free_port()
    config = write_config(tmp_path / "agent.yaml", {
        "run": {"name": "agent"}, "model": {"path": str(build_tiny_model(tmp_path / "tiny"))},
        "tasks": {"generate": None}, "serve": {"port": port, "max_tokens": 4},
        "store": {"url": url}})
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("RESERVOIR_DB_URL", None)
    process = subprocess.Popen([str(RESERVOIR), "serve", str(config)], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        wait_for(lambda: process.poll() is not None or responds(f"{base[:-3]}/health"), timeout=120)
        publish_start(url, config)
        wait_for(lambda: published(base, 0), timeout=30)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        before = Episode(client, "before")
        before.create(model="agent", messages=USER)
        stop()
        for index in range(3):  # while the store is down
            with pytest.raises(openai.InternalServerError, match="unreachable"):
                client.chat.completions.create(model="agent", messages=USER, user=f"e{index}")
        with pytest.raises(ReservoirError, match="HTTP 503"):
            before.report(1.0)
        start_again()
        client.chat.completions.create(model="agent", messages=USER, user="after")
        answered = {"before", "after"}
        assert {row[0] for row in query(url, "SELECT key FROM episodes")} == answered
        assert query(url, "SELECT count(*) FROM episode_calls")[0][0] == len(answered)
        before.report(1.0)
        assert query(url, "SELECT count(*) FROM experiences") == [(1,)]
    finally:
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=60)[0]
    assert "Traceback" not in output, output


# -- issue 28: what a web page, a big or strange number, a big body or another client can do --

def test_pages_numbers_big_bodies_and_other_clients_change_nothing(served, db_url):
    """Items 5-8 and 11 of issue 28 against one server: a page of another origin (a
    text/plain POST, Origin or Host of evil.example) was answered and recorded; reward 1e39 and
    10**400 were taken or a 500; a 30 MB prompt took 98 s of CPU before its 400; any client
    could add calls to, or report, another client's episode; JSON nested 100,000 deep was a
    500. Each is refused now, and nothing is stored."""
    import json
    import time

    from reservoir.agent import Episode

    base = served.up(served())
    publish_start(db_url, served.config)
    wait_for(lambda: published(base, 0), timeout=30)
    host = f"127.0.0.1:{served.port}"
    chat = json.dumps({"model": "agent", "messages": USER, "user": "alice-ep"})
    feedback = json.dumps({"episode_id": "alice-ep", "reward": 1})
    for headers, status in (({"content-type": "text/plain"}, 415),
                            ({"content-type": "application/x-www-form-urlencoded"}, 415),
                            ({"content-type": "application/json",
                              "origin": "http://evil.example"}, 403),
                            ({"content-type": "application/json", "origin": "null"}, 403),
                            ({"content-type": "application/json", "host": "evil.example"}, 421),
                            ({"content-type": "application/json",
                              "host": f"evil.example:{served.port}"}, 421)):
        for path, body in (("chat/completions", chat), ("feedback", feedback)):
            response = httpx.post(f"{base}/{path}", content=body, headers=headers)
            assert response.status_code == status, (path, headers, response.text)
    assert httpx.get(f"{base}/models", headers={"host": "evil.example"}).status_code == 421
    same_origin = {"content-type": "application/json", "origin": f"http://{host}"}
    assert httpx.post(f"{base}/chat/completions", content=chat,
                      headers=same_origin).status_code == 200
    assert counts(db_url) == (1, 1, 0)

    alice = Episode(openai.OpenAI(base_url=base, api_key="unused"), "bound-ep", base_url=base)
    alice.create(model="agent", messages=USER, n=2)
    stranger = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="opened it"):
        stranger.chat.completions.create(model="agent", messages=USER, user="bound-ep")
    with pytest.raises(ReservoirError, match="HTTP 403"):
        report_reward(base, "bound-ep", 1.0)
    assert counts(db_url) == (2, 3, 0)

    def post(body: bytes, path: str = "feedback") -> httpx.Response:
        return httpx.post(f"{base}/{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"})

    for number in (b"1e39", b"1e400", b"1" + b"0" * 400, b"-1e7", b"1e6"):
        body = b'{"episode_id": "bound-ep", "reward": %s, "episode_secret": "%s"}' % (
            number, alice.secret.encode())
        status = post(body).status_code
        assert status == (200 if number == b"1e6" else 400), (number, status)
    assert counts(db_url) == (2, 1, 2)  # bound-ep was rewarded 1e6, the limit, and no more
    deep = b'{"model": "agent", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert post(deep, "chat/completions").status_code == 400
    began = time.monotonic()
    huge = post(json.dumps({"model": "agent", "messages": [
        {"role": "user", "content": "x" * 30_000_000}]}).encode(), "chat/completions")
    assert huge.status_code == 413 and time.monotonic() - began < 10, huge.text
    many = [{"role": "user", "content": "a"}] * 5_000
    assert post(json.dumps({"model": "agent", "messages": many}).encode(),
                "chat/completions").status_code == 400
    assert counts(db_url) == (2, 1, 2)


def test_a_colocated_run_serves_its_own_module_between_its_steps(tmp_path, db_url):
    """`serve:` in a colocated run: the run's one process serves the endpoint from the module
    it trains. Calls generate only between steps, tagged with the version that generated them:
    a call after step 1 carries version 1 and its logprobs are version 1's (the checkpoint of
    step 1) to 1e-4; `reservoir serve` refuses such a config."""
    from reservoir.models import load_model

    port = free_port()
    config = write_config(tmp_path / "agent.yaml", {
        "run": {"name": "agent", "placement": "colocated"},
        "model": {"path": str(build_tiny_model(tmp_path / "tiny"))},
        "tasks": {"generate": None}, "serve": {"port": port, "max_tokens": 8},
        "trainer": {"algorithm": "grpo", "steps": 2, "batch_groups": 2, "micro_batch": 8,
                    "eval_interval": 100, "checkpoint_interval": 1, "lr": 0.05,
                    "checkpoint_dir": str(tmp_path / "checkpoints")},
        "store": {"url": db_url}})
    refused = subprocess.run([str(RESERVOIR), "serve", str(config)], capture_output=True,
                             text=True, cwd=tmp_path)
    assert refused.returncode == 1 and "run.placement is colocated: its trainer's process " \
        "serves" in refused.stderr, refused.stderr
    run = start("run", str(config), cwd=tmp_path)
    base = f"http://127.0.0.1:{port}/v1"
    wait_for(lambda: run.poll() is not None or responds(f"{base[:-3]}/health"), timeout=120)
    assert run.poll() is None, run.stdout.read()
    wait_for(lambda: published(base, 0), timeout=120)
    client = openai.OpenAI(base_url=base, api_key="unused")

    def episode(name: str, version: int):
        call = Episode(client, name)
        sent = call.create(model="agent", messages=USER, n=2, logprobs=True)
        assert sent.system_fingerprint == f"reservoir-v{version}"
        call.report(rewards=[0.0, 1.0])
        return sent

    for name in ("a", "b"):  # step 1 trains on them
        episode(name, 0)
    wait_for(lambda: published(base, 1), timeout=120)
    after = episode("c", 1)
    episode("d", 1)  # step 2
    finish(run, timeout=240)
    found = ledger(db_url)
    assert found["steps"] == [0, 1, 2] and found["status"] == "finished", found
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0)
    assert query(db_url, "SELECT t.step, min(e.policy_version), max(e.policy_version) FROM "
                         "train_steps t JOIN batch_items b ON b.train_step_id = t.id JOIN "
                         "experiences e ON e.id = b.experience_id GROUP BY t.step "
                         "ORDER BY t.step") == [(1, 0, 0), (2, 1, 1)]
    prompt, response = query(db_url, "SELECT prompt_ids, response_ids FROM experiences WHERE "
                                     "metadata->>'episode' = 'c' ORDER BY group_row")[0]
    ids = [*codec.decode(prompt, codec.TOKEN), *codec.decode(response, codec.TOKEN)]
    model = load_model(tmp_path / "checkpoints" / "agent" / "step-000001")[0].eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    start_at = len(codec.decode(prompt, codec.TOKEN)) - 1
    expected = logits[start_at:].gather(1, torch.tensor(ids[start_at + 1:])[:, None])[:, 0]
    sent = [token.logprob for token in after.choices[0].logprobs.content]
    np.testing.assert_allclose(sent, expected.numpy(), atol=1e-4)
