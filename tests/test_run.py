"""Short runs on the real store with Ray worker pools: sync and async, the ledger and staleness."""

import pytest
from sqlalchemy import text

from reservoir import pool
from reservoir.config import parse_config
from reservoir.errors import ConfigError, StoreError
from reservoir.models import build_tiny_model
from reservoir.report import write_report
from reservoir.store import Store
from reservoir.store.engine import sync_engine

LEDGER = {
    "steps": "SELECT array_agg(step ORDER BY step) FROM train_steps",
    "bad_steps": "SELECT count(*) FROM train_steps t WHERE t.step > 0 AND t.n_experiences <> "
                 "(SELECT count(*) FROM batch_items b WHERE b.train_step_id = t.id)",
    "trained_twice": "SELECT count(*) FROM (SELECT experience_id FROM batch_items "
                     "GROUP BY 1 HAVING count(*) > 1) twice",
    "max_staleness": "SELECT max(b.policy_version - e.policy_version) FROM batch_items b "
                     "JOIN experiences e ON e.id = b.experience_id",
    "versions": "SELECT array_agg(version ORDER BY version) FROM policy_versions",
    "status": "SELECT status FROM runs",
    "live_claims": "SELECT count(*) FROM tasks WHERE claim_token IS NOT NULL",
}


def run_config(tmp_path, db_url, **sections):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    raw = {"run": {"name": "r"}, "model": {"path": str(model)},
           "tasks": {"generate": "reverse", "count": 80},
           "explorer": {"n": 4, "batch_tasks": 2, "max_tokens": 5, "workers": 2},
           "trainer": {"steps": 4, "batch_groups": 3, "micro_batch": 12, "eval_interval": 2,
                       "checkpoint_dir": str(tmp_path / "checkpoints")},
           "store": {"url": db_url}}
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return parse_config(raw)


def ledger(db_url) -> dict:
    with sync_engine(db_url).connect() as conn:
        return {name: conn.execute(text(sql)).scalar() for name, sql in LEDGER.items()}


@pytest.mark.slow
@pytest.mark.both_servers
def test_sync_run_is_on_policy_and_every_step_has_its_ledger(tmp_path, db_url):
    summary = pool.run(run_config(tmp_path, db_url))
    assert (summary.steps, summary.version) == (4, 4)
    assert [step for step, _ in summary.accuracy] == ["start", 2, 4]
    assert ledger(db_url) == {"steps": [0, 1, 2, 3, 4], "bad_steps": 0, "trained_twice": 0,
                              "max_staleness": 0, "versions": [0, 1, 2, 3, 4],
                              "status": "finished", "live_claims": 0}
    with sync_engine(db_url).connect() as conn:  # explorers stop at the last step's need
        assert conn.execute(text("SELECT count(DISTINCT group_id) FROM experiences")
                            ).scalar() == 4 * 3
    config = run_config(tmp_path, db_url)
    with pytest.raises(ConfigError, match="run 'r' has already trained; continue it with --resume"):
        pool.train(config)
    elsewhere = config.model_copy(update={"trainer": config.trainer.model_copy(
        update={"checkpoint_dir": tmp_path / "elsewhere"})})
    with pytest.raises(StoreError, match="--resume: run 'r' is finished \\(4 of 4 steps\\); "
                                         "nothing to resume"):
        pool.train(elsewhere, resume=True)
    assert ledger(db_url)["status"] == "finished"  # refusing to start changed nothing
    with Store(db_url) as store:
        page = write_report(store, "r", tmp_path / "report")
    names = {"reward_per_step", "accuracy_per_step", "per_minute", "response_length", "staleness"}
    assert {p.stem for p in page.parent.glob("*.png")} == names
    assert all(f'src="{name}.png"' in page.read_text() for name in names)


@pytest.mark.slow
def test_async_run_stays_within_max_staleness(tmp_path, db_url):
    config = run_config(tmp_path, db_url, run={"name": "r", "mode": "async"},
                        sampler={"max_staleness": 1},
                        trainer={"steps": 6, "batch_groups": 2, "micro_batch": 8,
                                 "eval_interval": 6})
    summary = pool.run(config)
    found = ledger(db_url)
    assert summary.steps == 6 and found["steps"] == list(range(7))
    assert found["versions"] == list(range(7))
    assert found["max_staleness"] <= 1
    assert (found["bad_steps"], found["trained_twice"], found["status"]) == (0, 0, "finished")


def test_bad_run_configs_name_the_key(tmp_path, db_url):
    with pytest.raises(ConfigError, match=r"model.path: .*nowhere is not a model folder"):
        pool.run(parse_config({"model": {"path": str(tmp_path / "nowhere")},
                               "store": {"url": db_url}}))
    with pytest.raises(ConfigError, match=r"trainer.stepz: unknown key; did you mean 'steps'"):
        parse_config({"trainer": {"stepz": 3}})
    with pytest.raises(ConfigError, match=r"explorer.n: Input should be a valid integer"):
        parse_config({"explorer": {"n": "eight"}})
    with pytest.raises(ConfigError, match=r"sampler.max_staleness is unset"):
        parse_config({"run": {"mode": "async"}})


@pytest.mark.slow
@pytest.mark.both_servers
def test_a_stream_pipeline_decides_what_the_trainer_may_lease(tmp_path, db_url):
    pipeline = tmp_path / "gate.yaml"
    pipeline.write_text("mode: stream\nsource: {status: [raw]}\n"
                        "process:\n  - text_length_filter: {min_len: 3}\n"
                        "  - human_review_router: {fraction: 0.3}\n")  # holds ~30 %
    config = run_config(tmp_path, db_url, explorer={"workers": 1, "max_tokens": 6},
                        trainer={"steps": 3, "eval_interval": 3})
    config = config.model_copy(update={"pipelines": (pipeline,)})
    summary = pool.run(config)
    assert summary.steps == 3
    found = ledger(db_url)
    assert (found["bad_steps"], found["trained_twice"], found["status"]) == (0, 0, "finished")
    with sync_engine(db_url).connect() as conn:
        trained_but_dropped = conn.execute(text(
            "SELECT count(*) FROM batch_items b JOIN operator_events o "
            "ON o.experience_id = b.experience_id WHERE o.kind = 'dropped'")).scalar()
        short_trained = conn.execute(text(
            "SELECT count(*) FROM batch_items b JOIN experiences e ON e.id = b.experience_id "
            "WHERE length(e.response_text) < 3")).scalar()
        passes = conn.execute(text("SELECT count(*) FROM pipeline_runs WHERE trigger = 'stream' "
                                   "AND status = 'succeeded'")).scalar()
        held = conn.execute(text("SELECT count(*) FROM experiences e JOIN reviews r "
                                 "ON r.experience_id = e.id WHERE e.status = 'held'")).scalar()
        held_trained = conn.execute(text(
            "SELECT count(*) FROM batch_items b JOIN reviews r USING (experience_id)")).scalar()
    assert trained_but_dropped == 0 and short_trained == 0 and held_trained == 0
    assert passes >= 1 and held > 0
