"""A short sync run on the real store: steps commit their ledger, versions advance, on-policy."""

import pytest
import torch
from sqlalchemy import text

from reservoir.config import parse_config
from reservoir.errors import ConfigError
from reservoir.models import build_tiny_model, load_model
from reservoir.report import write_report
from reservoir.run import run_sync
from reservoir.store.engine import sync_engine


def test_sync_run_trains_on_policy_through_the_store(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    config = parse_config({
        "run": {"name": "sync"}, "model": {"path": str(model)},
        "tasks": {"generate": "addition", "count": 60},
        "explorer": {"n": 4, "tasks_per_step": 3, "max_tokens": 6},
        "trainer": {"steps": 3, "batch_groups": 3, "micro_batch": 6, "eval_interval": 3,
                    "checkpoint_dir": str(tmp_path / "checkpoints")},
        "store": {"url": db_url}})
    summary = run_sync(config)
    assert (summary.steps, summary.version) == (3, 3)
    assert [step for step, _ in summary.accuracy] == ["start", 3]
    with sync_engine(db_url).connect() as conn:
        steps = conn.execute(text("SELECT step, policy_version, n_experiences FROM train_steps "
                                  "ORDER BY step")).all()
        accuracy = conn.execute(text("SELECT step FROM train_steps "
                                     "WHERE metrics ? 'eval/accuracy' ORDER BY step")).scalars().all()
        stale = conn.execute(text(
            "SELECT count(*) FROM batch_items b JOIN experiences e ON e.id = b.experience_id "
            "WHERE e.policy_version <> b.policy_version")).scalar()
        versions = conn.execute(text("SELECT array_agg(version ORDER BY version) "
                                     "FROM policy_versions")).scalar()
    assert [(s.step, s.policy_version, s.n_experiences) for s in steps] == [
        (0, 0, 0), (1, 0, 12), (2, 1, 12), (3, 2, 12)]
    assert accuracy == [0, 3]
    assert stale == 0 and versions == [0, 1, 2, 3]


def test_report_writes_plots_and_a_page(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=1)
    config = parse_config({
        "run": {"name": "rep"}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 40},
        "explorer": {"n": 2, "tasks_per_step": 2, "max_tokens": 4},
        "trainer": {"steps": 2, "batch_groups": 2, "micro_batch": 4, "eval_interval": 1,
                    "checkpoint_dir": str(tmp_path / "checkpoints")},
        "store": {"url": db_url}})
    run_sync(config)
    page = write_report(sync_engine(db_url), "rep", tmp_path / "report")
    names = {"reward_per_step", "accuracy_per_step", "per_minute", "response_length", "staleness"}
    assert {p.stem for p in page.parent.glob("*.png")} == names
    assert all((page.parent / f"{name}.png").stat().st_size > 5000 for name in names)
    assert all(f'src="{name}.png"' in page.read_text() for name in names)



def resume_config(model, db, checkpoints, steps):
    return parse_config({
        "run": {"name": "resumable", "seed": 5}, "model": {"path": str(model)},
        "tasks": {"generate": "addition", "count": 50},
        "explorer": {"n": 3, "tasks_per_step": 2, "max_tokens": 5},
        "trainer": {"steps": steps, "batch_groups": 2, "micro_batch": 3, "eval_interval": 10,
                    "checkpoint_interval": 2, "checkpoint_dir": str(checkpoints), "lr": 0.01},
        "store": {"url": db}})


def test_resume_matches_a_run_never_interrupted(tmp_path, new_database, template_db):
    model = build_tiny_model(tmp_path / "tiny", seed=2)
    straight, split = new_database(template_db), new_database(template_db)
    run_sync(resume_config(model, straight, tmp_path / "a", steps=4))
    run_sync(resume_config(model, split, tmp_path / "b", steps=2))
    with pytest.raises(ConfigError, match="already exists"):
        run_sync(resume_config(model, split, tmp_path / "b", steps=4))
    resumed = run_sync(resume_config(model, split, tmp_path / "b", steps=4), resume=True)
    assert (resumed.steps, resumed.version) == (4, 4)
    final = [load_model(tmp_path / side / "resumable" / "step-000004")[0].state_dict()
             for side in ("a", "b")]
    for name, tensor in final[0].items():
        torch.testing.assert_close(final[1][name], tensor, atol=1e-6, rtol=0, msg=name)
    for db in (straight, split):
        with sync_engine(db).connect() as conn:
            assert conn.execute(text("SELECT array_agg(step ORDER BY step) FROM train_steps")
                                ).scalar() == [0, 1, 2, 3, 4]
            assert conn.execute(text("SELECT status FROM runs")).scalar() == "finished"


def test_bad_run_configs_name_the_key(tmp_path, db_url):
    with pytest.raises(ConfigError, match=r"model.path: .*nowhere is not a model folder"):
        run_sync(parse_config({"model": {"path": str(tmp_path / "nowhere")},
                               "store": {"url": db_url}}))
    with pytest.raises(ConfigError, match=r"trainer.stepz: unknown key; did you mean 'steps'"):
        parse_config({"trainer": {"stepz": 3}})
    with pytest.raises(ConfigError, match=r"explorer.n: Input should be a valid integer"):
        parse_config({"explorer": {"n": "eight"}})
