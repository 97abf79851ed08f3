"""A short sync run on the real store: steps commit their ledger, versions advance, on-policy."""

from sqlalchemy import text

from reservoir.config import parse_config
from reservoir.models import build_tiny_model
from reservoir.report import write_report
from reservoir.run import run_sync
from reservoir.store.engine import sync_engine


def test_sync_run_trains_on_policy_through_the_store(tmp_path, db_url):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    config = parse_config({
        "run": {"name": "sync"}, "model": {"path": str(model)},
        "tasks": {"generate": "addition", "count": 60},
        "explorer": {"n": 4, "tasks_per_step": 3, "max_tokens": 6},
        "trainer": {"steps": 3, "batch_groups": 3, "micro_batch": 6, "eval_interval": 3},
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
        "trainer": {"steps": 2, "batch_groups": 2, "micro_batch": 4, "eval_interval": 1},
        "store": {"url": db_url}})
    run_sync(config)
    page = write_report(sync_engine(db_url), "rep", tmp_path / "report")
    names = {"reward_per_step", "accuracy_per_step", "per_minute", "response_length", "staleness"}
    assert {p.stem for p in page.parent.glob("*.png")} == names
    assert all((page.parent / f"{name}.png").stat().st_size > 5000 for name in names)
    assert all(f'src="{name}.png"' in page.read_text() for name in names)
