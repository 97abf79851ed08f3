"""Hundreds of bad inputs of every kind a user hands over (configs, task files, experience
records, pipeline files): each is refused with one line naming the file, key, row or field,
and the store is exactly as before."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import replace

import pytest
from pydantic import BaseModel

from reservoir.config import ReservoirConfig, load_config
from reservoir.errors import ReservoirError
from reservoir.explorer.tasks import read_task_file
from reservoir.pipeline.check import check_file
from tests.commands import scalar
from tests.factories import make_group

BAD_NUMBERS = [True, -1, 10**20, "abc", ".inf", ".nan", "[]", "{}", "1.5"]


def numeric_keys() -> list[tuple[str, str, type]]:
    """(section, key, type) of every int or float setting in the config models."""
    found = []
    for section, field in ReservoirConfig.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for key, sub in model.model_fields.items():
            text = str(sub.annotation)
            if "dict" in text:
                continue  # a mapping of numbers (Ray resources): its own tests check values
            kind = int if "int" in text else float if "float" in text else None
            if kind is not None:
                found.append((section, key, kind))
    return found


def bad_configs() -> list[str]:
    cases = []
    for section, key, kind in numeric_keys():
        for value in BAD_NUMBERS:
            if kind is float and value in (-1, "1.5", 10**20) and key not in ("lr",):
                continue  # plausible floats for some keys: covered by their own bounds below
            cases.append(f"{section}:\n  {key}: {json.dumps(value) if not isinstance(value, str) else value}\n")
    names = ["''", "'a b'", "'../x'", "'a\\x00b'", "x" * 101, "'-x'", "'.'", "5"]
    cases += [f"run:\n  name: {name}\n" for name in names]
    cases += [
        "sampler:\n  lease_seconds: 0\n", "sampler:\n  poll_interval_s: 0\n",
        "trainer:\n  lr: 2\n", "explorer:\n  temperature: 0\n", "explorer:\n  n: 100000\n",
        "tasks:\n  generate: null\n", "tasks:\n  generate: bogus\n", "tasks:\n  test_fraction: 1\n",
        "store:\n  url: mysql://x@y/z\n", "store:\n  url: 5\n", "run:\n  mode: fast\n",
        "run:\n  name: a\nrun:\n  name: b\n", "trainer:\n  steps: 1\n  steps: 2\n",
        "trainer: [1, 2]\n", "- a\n", "samplr: {}\n", "trainer:\n  stepz: 3\n",
        "run: {mode: async}\n", "sampler: {sample_from: [consumed], max_times_sampled: 1}\n",
        "trainer:\n  algorithm: ppo2\n", "pipelines: [1, 2]\n", "trainer:\n  lr: [\n",
        "explorer:\n  reward: nope\n", "store:\n  query_timeout_s: 0\n",
        # issue 28
        "tasks: {file: t.jsonl, generate: reverse}\n",
        "stages:\n  - {name: s, algorithm: sft, data: tasks}\n",
        "stages:\n  - {name: s, algorithm: sft, steps: 2, data: {stored: {where: 'true) OR "
        "(true'}}}\n",
        "stages:\n  - {name: s, algorithm: sft, steps: 2, data: {stored: {where: \"true --\\r"
        ") OR (true\"}}}\n",
        "explorer: {reward_range: [1, -1]}\n", "explorer: {reward_range: [-1e39, 1]}\n",
        "serve: {max_request_bytes: 0}\n",
    ]
    return cases


@pytest.mark.parametrize("body", bad_configs())
def test_a_bad_config_is_one_line_naming_the_file(tmp_path, body):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ReservoirError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message


def bad_task_lines() -> list[str]:
    prompts = ['""', '" "', "5", "null", "[1]", '{"a": 1}', '"\\u0000"', '"\\ud800"', "true"]
    lines = [f'{{"prompt": {p}}}' for p in prompts]
    lines += [f'{{"prompt": "p", "answer": {a}}}' for a in ('{"a": 1}', "[1]", '"\\u0000"')]
    lines += [f'{{"prompt": "p", "split": {s}}}' for s in ('"dev"', '"TRAIN"', "1", '""x"')]
    lines += [f'{{"prompt": "p", "w": {v}}}' for v in ("Infinity", "-Infinity", "NaN",
                                                      '"\\u0000"', '["\\ud800"]',
                                                      '{"k": "\\u0000"}')]
    lines += ["[]", '"p"', "1", "null", '{"prompt": "p"', "{", '{"prompt": "a", "prompt": "b"}',
              '{"question": "no prompt"}']
    # issue 28: a task without its answer; JSON nested 5,000 deep was a RecursionError
    lines += ['{"prompt": "p"}', '{"prompt": "p", "answer": null}',
              '{"prompt": "p", "answer": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}"]
    return lines


@pytest.mark.parametrize("line", bad_task_lines())
def test_a_bad_task_line_is_one_line_naming_the_file(tmp_path, line):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "fine", "answer": "ok"}\n' + line + "\n")
    with pytest.raises(ReservoirError) as info:
        read_task_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message


BAD_CSV = ["prompt\n\n", "prompt,answer\n ,1\n", "prompt,split\np,dev\n", "answer\n1\n",
           "prompt\na\x00b\n"]


@pytest.mark.parametrize("body", BAD_CSV)
def test_a_bad_csv_is_one_line(tmp_path, body):
    path = tmp_path / "tasks.csv"
    path.write_bytes(body.encode())
    with pytest.raises(ReservoirError) as info:
        read_task_file(path)
    assert "\n" not in str(info.value)


def bad_records() -> list:
    fields = {
        "run": [5, None, b"r"], "prompt_text": [None, 5, "a\x00", "\ud800"],
        "response_text": [None, 5, "", " ", b"x", "\udfff", "a\x00b"],
        "prompt_ids": [[1.5], [-1], [2**31], "abc", [[1]], None],
        "response_ids": [[], [1.5] * 6, [-1] * 6, "abcdef", None],
        "reward": [math.nan, math.inf, -math.inf, "1", None, True, [1.0]],
        "policy_version": [-1, 2**31, 1.5, "0", None, True],
        "task_id": ["x", -1, 0, True, 1.5],
        "group_id": ["abc", 5, b"x" * 16],
        "logprobs": [[math.nan] * 6, [-1e300] * 6, [0.5] * 6, ["x"] * 6, [-0.1] * 5, "x"],
        "action_mask": [[2] * 6, [0.5] * 6, [-1] * 6, [1] * 5, "x"],
        "reward_components": [{"a": math.nan}, {"a": "x"}, [1], {1: 1.0}, None],
        "metadata": [{"a": math.nan}, {"a": object()}, [1], None, "x"],
        "parent_id": ["x", -1, 1.5],
    }
    return [pytest.param(name, value, id=f"{name}-{i}")
            for name, values in fields.items() for i, value in enumerate(values)]


@pytest.mark.parametrize("field_name, value", bad_records())
def test_a_bad_record_is_refused_in_one_line_and_writes_nothing(store, field_name, value):
    store.create_run("f", group_size=4)
    before = scalar(store.url, "SELECT count(*) FROM experiences")
    group = make_group("f", seed=1)
    group[1] = replace(group[1], **{field_name: value})
    if field_name in ("run", "task_id", "group_id", "policy_version"):
        group = [replace(exp, **{field_name: value}) for exp in group]
    with pytest.raises(ReservoirError) as info:
        store.write_groups([make_group("f", seed=0), group])
    assert "\n" not in str(info.value)
    assert scalar(store.url, "SELECT count(*) FROM experiences") == before


def test_bad_batches_and_statuses(store):
    store.create_run("f", group_size=4)
    for batch, kwargs in [(make_group("f"), {}), ("groups", {}), ([[1, 2]], {}),
                          ([make_group("f")], {"status": "consumed"}),
                          ([make_group("f")], {"status": "held"}), ([make_group("f")[:3]], {}),
                          ([make_group("f", group_id=uuid.UUID(int=1))] * 2, {}), ([[]], {})]:
        with pytest.raises(ReservoirError) as info:
            store.write_groups(batch, **kwargs)
        assert "\n" not in str(info.value)
    assert scalar(store.url, "SELECT count(*) FROM experiences") == 0


def bad_pipelines() -> list[str]:
    op = "process:\n  - text_length_filter: {args}\n"
    cases = [op.format(args=a) for a in (
        "{min_len: -5}", "{min_len: 9, max_len: 2}", "{max_len: .inf}", "{min_lenn: 3}",
        "{min_len: abc}", "{skip_op_error: true}", "{min_len: .nan}", "{num_proc: -1}",
        "[1, 2]", "{min_len: [1]}")]
    cases += [
        "process:\n  - no_such_filter: {}\n", "process:\n  - {}\n",
        "process:\n  - a_filter: {}\n    b_filter: {}\n",
        "process:\n  - reward_range_filter: {min_reward: 2, max_reward: 1}\n",
        "process:\n  - length_penalty_mapper: {max_len: -1}\n",
        "source: {status: [consumed]}\n", "source: {status: [leased]}\n",
        "source: {status: [held]}\n", "source: {status: []}\n", "source: {status: bogus}\n",
        "source: {where: 'true); DROP TABLE t; --'}\n", "source: {where: 'false) OR (true'}\n",
        "source: {where: 'x;'}\n", "source: {where: '(('}\n", "source: {where: ''}\n",
        "source: {limit: 0}\n", "source: {limit: -3}\n", "source: {limit: 1.5}\n",
        "source: {order_by: [nope]}\n", "source: {order_by: [reward; drop]}\n",
        "source: {timeout_s: 0}\n", "source: {timeout_s: .inf}\n", "source: {runs: ['a b']}\n",
        "source: {table: runs}\n", "source: {tabel: experiences}\n",
        "output: {status: consumed}\n", "output: {dropped: ready}\n",
        "output: {partial_groups: maybe}\n", "output: {unselected: quarantined}\n",
        "output: {mapped: replace}\n", "mode: forever\n", "schedule: every tuesday\n",
        "schedule: '* * *'\n", "validate: {on_failure: explode}\n",
        "validate:\n  expectations:\n    - expect_column_values_to_not_be_null: {column: nope}\n",
        "validate:\n  expectations:\n    - expect_nothing_at_all: {}\n",
        "validate:\n  expectations:\n    - expect_group_size: {n: 0}\n",
        "validate:\n  expectations:\n    - expect_column_values_to_be_between: {colum: reward}\n",
        "process: []\nprocess: []\n", "source: {runs: [a]}\nsource: {runs: [b]}\n",
        "name: 'bad name'\n", "- just a list\n", "process: [\n", "\x00\n", "text_key: [1]\n",
        "mode: stream\nprocess:\n  - topk_specified_field_selector: {field_key: reward, "
        "topk: 1}\n",
        # issue 28: empty files ran on every run; unknown fields and a 6-field cron passed
        "", "null\n", "output: {priority_from: nope}\n", "text_key: nope\n",
        "schedule: '0 */10 * * * *'\n", "source: {runs: everything}\n",
    ]
    return cases


@pytest.mark.parametrize("body", bad_pipelines())
def test_a_bad_pipeline_is_one_line_naming_the_file(tmp_path, body):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ReservoirError) as info:
        check_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message


def test_enough_cases():
    total = (len(bad_configs()) + len(bad_task_lines()) + len(BAD_CSV) + len(bad_records())
             + len(bad_pipelines()) + 8)
    assert total >= 300, total


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("args", [
    ("train", "CONFIG"), ("run", "CONFIG"), ("explore", "CONFIG"),
    ("tasks", "load", "TASKS", "--run", "t"), ("pipeline", "run", "PIPELINE"),
])
def test_bad_files_through_the_cli_change_nothing(cli, tmp_path, args):
    config, tasks, pipeline = tmp_path / "c.yaml", tmp_path / "t.jsonl", tmp_path / "p.yaml"
    config.write_text("run:\n  name: x\ntrainer:\n  steps: true\n")
    tasks.write_text('{"prompt": "p", "w": Infinity}\n')
    pipeline.write_text("source: {status: [consumed]}\n")
    swap = {"CONFIG": str(config), "TASKS": str(tasks), "PIPELINE": str(pipeline)}
    before = scalar(cli.url, "SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM tasks)"
                             " + (SELECT count(*) FROM pipeline_runs)")
    result = cli.raw(*[swap.get(a, a) for a in args])
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert scalar(cli.url, "SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM tasks)"
                           " + (SELECT count(*) FROM pipeline_runs)") == before



@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("args, created", [
    (("tasks", "load", "TASKS", "--run", ""), "runs"),
    (("tasks", "load", "TASKS", "--run", "a b"), "runs"),
    (("tasks", "load", "TASKS", "--run", "../x"), "runs"),
    (("demo", "store", "--run=-x", "--groups", "2"), "runs"),
    (("train", "STAGELESS"), "runs"),
    (("pipeline", "run", "EMPTY"), "pipeline_runs"),
    (("pipeline", "run", "NAMES_NO_RUN"), "pipeline_runs"),
    (("schedule", "add", "NAMES_NO_RUN", "--cron", "* * * * *"), "schedules"),
])
def test_issue_28_inputs_through_the_cli_create_nothing(cli, tmp_path, args, created):
    """A run named '' or '../x' was created; a stage without steps created its run, then
    printed a 44-line TypeError; an empty pipeline file moved every raw row of every run."""
    cli("demo", "store", "--groups", "4", "--group-size", "2", "--steps", "1",
        "--groups-per-step", "1", "--raw-groups", "2")
    files = {"TASKS": ('t.jsonl', '{"prompt": "p", "answer": "a"}\n'),
             "STAGELESS": ("c.yaml", "run: {name: stageless}\nstages:\n  - {name: s, algorithm: "
                                      "sft, data: tasks}\n"),
             "EMPTY": ("empty.yaml", ""), "NAMES_NO_RUN": ("p.yaml", "process: []\n")}
    swap = {}
    for key, (name, body) in files.items():
        (tmp_path / name).write_text(body)
        swap[key] = str(tmp_path / name)
    counts = ("SELECT concat_ws('|', (SELECT count(*) FROM runs), (SELECT count(*) FROM "
              "pipeline_runs), (SELECT count(*) FROM schedules), (SELECT json_object_agg("
              "status, n ORDER BY status) FROM (SELECT status, count(*) AS n FROM experiences "
              "GROUP BY status) s))")
    before = scalar(cli.url, counts)
    result = cli.raw(*[swap.get(a, a) for a in args])
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert scalar(cli.url, counts) == before
