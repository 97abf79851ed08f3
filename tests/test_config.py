"""reservoir.config: YAML files in, typed config or a ConfigError naming file and key out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reservoir.config import ReservoirConfig, StoreConfig, load_config
from reservoir.plan.urls import DB_URL_ENV
from reservoir.errors import ConfigError


@pytest.fixture
def write(tmp_path):
    def write(body: str) -> Path:
        path = tmp_path / "reservoir.yaml"
        path.write_text(body)
        return path
    return write


def config_error(path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_valid_file_and_defaults(write):
    config = load_config(write("sampler:\n  max_staleness: 2\n  order: priority\n"))
    assert (config.sampler.max_staleness, config.sampler.order) == (2, "priority")
    assert config.sampler.lease_seconds == 300.0
    assert load_config(None) == ReservoirConfig() == load_config(write(""))


def test_unknown_key_names_file_path_and_suggestion(write):
    path = write("sampler:\n  max_stalenes: 3\n")
    message = config_error(path)
    assert str(path) in message
    assert "sampler.max_stalenes (line 2): unknown key" in message
    assert "did you mean 'max_staleness'" in message


def test_unknown_key_without_close_match_lists_the_valid_keys(write):
    message = config_error(write("store:\n  zzz: 1\n"))
    assert "store.zzz" in message and "valid keys: url, urls, data_dir" in message


def test_unknown_section_suggests_one(write):
    message = config_error(write("samplr:\n  order: lifo\n"))
    assert "samplr (line 1): unknown key; did you mean 'sampler'" in message


@pytest.mark.parametrize("body, key", [
    ("sampler:\n  lease_seconds: soon\n", "sampler.lease_seconds"),
    ("sampler:\n  order: random\n", "sampler.order"),
    ("sampler:\n  min_ready: 0\n", "sampler.min_ready"),
    ("sampler:\n  sample_from: [ready, bogus]\n", "sampler.sample_from.1"),
    ("store: 5\n", "store"),
])
def test_wrong_type_or_value_names_the_key(write, body, key):
    path = write(body)
    message = config_error(path)
    assert str(path) in message
    assert re.search(rf"[:;] {re.escape(key)}( \(line \d+\))?: ", message), message


def test_invalid_yaml_names_the_file(write):
    path = write("sampler: [unclosed\n")
    message = config_error(path)
    assert message.startswith(f"{path}: not valid YAML")


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "absent.yaml"
    assert config_error(path) == f"{path}: config file not found"


@pytest.mark.parametrize("make", [lambda tmp: tmp, lambda tmp: tmp / "bad.yaml"],
                         ids=["directory", "not-utf8"])
def test_unreadable_file_names_the_file(tmp_path, make):
    # Regression guard (was a bug): config.py load_config catches only FileNotFoundError and yaml.YAMLError around
    # path.read_text(), so a directory (IsADirectoryError), an unreadable file (PermissionError)
    # or bytes that are not UTF-8 (UnicodeDecodeError) escape as bare exceptions, not ConfigError.
    (tmp_path / "bad.yaml").write_bytes(b"sampler:\n  order: \xff\n")
    path = make(tmp_path)
    assert config_error(path).startswith(f"{path}: ")


@pytest.mark.parametrize("body", ["- store\n- sampler\n", "just text\n", "42\n"])
def test_top_level_must_be_a_mapping(write, body):
    path = write(body)
    assert config_error(path) == f"{path}: the top level must be a mapping of sections"


def test_consumed_rows_need_max_times_sampled_above_one(write):
    message = config_error(write("sampler:\n  sample_from: [ready, consumed]\n"
                                 "  max_times_sampled: 1\n"))
    assert "sampler (line 1):" in message and "max_times_sampled is 1" in message
    config = load_config(write("sampler:\n  sample_from: [ready, consumed]\n"
                               "  max_times_sampled: 2\n"))
    assert config.sampler.sample_from == ("ready", "consumed")


def test_resolved_url_prefers_store_url_over_environment(monkeypatch):
    monkeypatch.setenv(DB_URL_ENV, "postgresql://env/db")
    assert StoreConfig(url="postgresql://config/db").resolved_url() == "postgresql://config/db"
    assert StoreConfig().resolved_url() == "postgresql://env/db"
    monkeypatch.setenv(DB_URL_ENV, "")
    assert StoreConfig().resolved_url() is None


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_number_that_is_not_finite_is_called_so(write, value):
    message = config_error(write(f"explorer:\n  temperature: {value}\n"))
    assert "explorer.temperature (line 2): must be a finite number" in message


@pytest.mark.parametrize("body, key, rule", [
    ("store:\n  retention:\n    archive_after_days: 0\n", "store.retention.archive_after_days",
     "greater than 0"),
    ("store:\n  retention:\n    retire_after_days: .nan\n", "store.retention.retire_after_days",
     "finite"),
    ("store:\n  retention:\n    archive_after_days: 30\n", "store.retention",
     "archive_after_days is set but archive_dir is not"),
])
def test_retention_checks_ranges_and_that_archiving_has_a_folder(write, body, key, rule):
    message = config_error(write(body))
    assert re.search(rf"[:;] {re.escape(key)} \(line \d+\): [^;]*{rule}", message), message
    config = load_config(write("store:\n  retention: {archive_dir: old, archive_after_days: 30, "
                               "retire_after_days: 7.5}\n"))
    assert (config.store.retention.archive_after_days, config.store.retention.retire_after_days
            ) == (30.0, 7.5)


@pytest.mark.parametrize("body, key", [
    ('store:\n  data_dir: "a\\0b"\n', "store.data_dir"),
    ('store:\n  retention: {archive_dir: "old\\0", archive_after_days: 30}\n',
     "store.retention.archive_dir"),
    ('model:\n  path: "models/\\0tiny"\n', "model.path"),
    ('tasks:\n  file: "tasks\\0.jsonl"\n', "tasks.file"),
    ('trainer:\n  checkpoint_dir: "\\0"\n', "trainer.checkpoint_dir"),
    ('pipelines: ["clean.yaml", "x\\0.yaml"]\n', "pipelines.1"),
    ('store:\n  data_dir: "  "\n', "store.data_dir"),
])
def test_a_path_with_a_nul_or_nothing_in_it_is_refused_naming_its_key(write, body, key):
    message = config_error(write(body))
    assert re.search(rf"{re.escape(key)} \(line \d+\): [^;]*without NUL", message), message


STAGES = """tasks: {{generate: reverse}}
trainer: {{{trainer}}}
stages:
  - {{name: warm, algorithm: sft, steps: 2, data: {data}}}
  - {{name: rl, algorithm: grpo, steps: 2}}
"""


@pytest.mark.parametrize("data, trainer, fraction, deprecated", [
    ("tasks", "", 0.5, False),
    ("{tasks: {fraction: 0.3}}", "", 0.3, False),
    ("{tasks: true}", "", 0.5, False),
    ("tasks", "warmup_fraction: 0.2", 0.2, True),                    # the old key still works
    ("{tasks: {fraction: 0.3}}", "warmup_fraction: 0.2", 0.3, True),  # the stage's own wins
])
def test_a_tasks_stage_takes_its_share_of_tasks_from_its_own_data(write, capsys, data, trainer,
                                                                   fraction, deprecated):
    """Issue 31: a `data: tasks` stage took its share from trainer.warmup_fraction, which
    users missed; the share is the stage's now, and the old key says it is deprecated."""
    from reservoir.plan.stages import plan

    config = load_config(write(STAGES.format(data=data, trainer=trainer)))
    warm = plan(config)[0]
    assert warm.data.kind == "tasks" and warm.data.tasks.fraction == fraction
    said = capsys.readouterr().err
    assert ("trainer.warmup_fraction is deprecated" in said) == deprecated
    assert said.count("\n") == deprecated  # one line


def test_the_classic_warm_up_keeps_trainer_warmup_fraction(write, capsys):
    from reservoir.plan.stages import plan

    config = load_config(write("tasks: {generate: reverse}\n"
                               "trainer: {warmup_steps: 3, warmup_fraction: 0.25}\n"))
    assert plan(config)[0].data.tasks.fraction == 0.25 and capsys.readouterr().err == ""


@pytest.mark.parametrize("body, key, rule", [
    ("explorer:\n  resources: {GPU: 1}\n", "explorer.resources", "'GPU' is Ray's own"),
    ("trainer:\n  resources: {CPU: 2}\n", "trainer.resources", "'CPU' is Ray's own"),
    ("explorer:\n  resources: {'a b': 1}\n", "explorer.resources", "resource name 'a b'"),
    ("explorer:\n  resources: {node_a: 0}\n", "explorer.resources", "not in \\(0, 1e6\\]"),
    ("explorer:\n  resources: {node_a: .inf}\n", "explorer.resources.node_a", "finite"),
    ("trainer:\n  resources: {node_a: yes}\n", "trainer.resources.node_a", ""),
])
def test_ray_resources_are_custom_named_and_in_range(write, body, key, rule):
    message = config_error(write(body))
    assert re.search(rf"{re.escape(key)} \(line \d+\): [^;]*{rule}", message), message
    config = load_config(write("explorer:\n  resources: {explorer_node: 0.5}\n"
                               "trainer:\n  resources: {'gpu-node:a100': 1}\n"))
    assert (config.explorer.resources, config.trainer.resources) == (
        {"explorer_node": 0.5}, {"gpu-node:a100": 1.0})
