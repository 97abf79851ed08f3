"""One class per tracker library, each imported only when configured.

A tracker takes a run's steps in order: `start(run, params, external_id)` opens (or, given the
id it returned before, continues) its run and returns its id; `last_logged()` is the last step
its own records hold (a process killed between logging a step and recording it in the store
logs it no second time); `log(step, scalars, stage, samples)` (samples: a few rows trained at
an evaluation, a table) for each step of a batch, then `flush()`; `artifacts(folder)` (the
run's report: PNG plots and index.html) and `close()`. Each step carries `reservoir/step`, so
the last one logged is read back from the tracker itself. Libraries are asked not to reach the
network unless told to (W&B offline, MLflow's retries bounded), since a tracker must never slow
or stop a run.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

STEP_KEY = "reservoir/step"  # logged with every step: the last one is read back from it


class TensorBoard:
    """Event files in `dir/<run>` (tensorboard's own event writer: no torch or TensorFlow)."""

    kind = "tensorboard"

    def __init__(self, settings) -> None:
        self.destination = str(Path(settings.dir).resolve())
        self.writer, self.stage, self.run, self.step = None, None, None, 0

    def start(self, run: str, params: dict[str, Any], external_id: str | None) -> str:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.run = run
        self.writer = EventFileWriter(str(Path(self.destination) / run), flush_secs=5)
        if external_id is None:
            self._text(0, "config", "\n".join(f"    {k}: {v}" for k, v in sorted(params.items())))
        return run

    def last_logged(self) -> int:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        folder = Path(self.destination) / self.run
        if not folder.exists():
            return -1
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        if STEP_KEY not in events.Tags()["scalars"]:
            return -1
        return max(int(e.step) for e in events.Scalars(STEP_KEY))

    def log(self, step: int, scalars: dict[str, float], stage: str | None,
            samples: list[dict] | None = None) -> None:
        from tensorboard.compat.proto import event_pb2

        event = event_pb2.Event(wall_time=time.time(), step=step)
        for tag, value in scalars.items():
            event.summary.value.add(tag=tag, simple_value=value)
        self.writer.add_event(event)
        self.step = step
        if stage != self.stage:
            self.stage = stage
            self._text(step, "stage", f"stage {stage!r} from step {step}")
        if samples:
            self._text(step, "samples", markdown_table(samples))

    def flush(self) -> None:
        self.writer.flush()

    def artifacts(self, folder: Path) -> None:
        """Each plot of the report as an image at the last step logged."""
        from tensorboard.compat.proto import event_pb2, summary_pb2

        for png in sorted(folder.glob("*.png")):
            data = png.read_bytes()
            width, height = struct.unpack(">II", data[16:24])  # the PNG's IHDR
            image = summary_pb2.Summary.Image(height=height, width=width, colorspace=4,
                                              encoded_image_string=data)
            event = event_pb2.Event(wall_time=time.time(), step=self.step)
            event.summary.value.add(tag=f"report/{png.stem}", image=image)
            self.writer.add_event(event)

    def _text(self, step: int, tag: str, text: str) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb

        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                              summary=text_pb(tag, text)))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Mlflow:
    """An MLflow run in `experiment` at `tracking_uri`; its run id continues it on resume."""

    kind = "mlflow"

    def __init__(self, settings) -> None:
        from reservoir.plan.urls import redact_text

        self.uri, self.experiment = settings.tracking_uri, settings.experiment
        self.destination = redact_text(self.uri)
        self.client, self.run_id, self.stage = None, None, None
        self.pending: list = []  # metrics logged, not yet sent (flush)

    def start(self, run: str, params: dict[str, Any], external_id: str | None) -> str:
        if self.uri.startswith("file:") or "://" not in self.uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3: opt in
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # default: 4 minutes
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if external_id is not None:
            self.run_id = external_id
            return external_id
        found = self.client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found else \
            self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment, run_name=run).info.run_id
        for key, value in list(params.items())[:500]:
            self.client.log_param(self.run_id, key, str(value)[:6000])
        return self.run_id

    def last_logged(self) -> int:
        history = self.client.get_metric_history(self.run_id, STEP_KEY)
        return max((int(m.step) for m in history), default=-1)

    def log(self, step: int, scalars: dict[str, float], stage: str | None,
            samples: list[dict] | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(key, value, now, step) for key, value in scalars.items()]
        if stage != self.stage:
            self.stage = stage
            self.client.set_tag(self.run_id, f"stage.{stage}", f"from step {step}")
        if samples:
            columns = {key: [row[key] for row in samples] for key in samples[0]}
            self.client.log_table(self.run_id, data={"step": [step] * len(samples), **columns},
                                  artifact_file=f"samples/step-{step:06d}.json")

    def flush(self) -> None:
        """The metrics of the steps logged since the last flush, 1,000 a request (MLflow's
        most): one request for many steps, not one a step."""
        pending, self.pending = self.pending, []
        for first in range(0, len(pending), 1000):
            self.client.log_batch(self.run_id, metrics=pending[first:first + 1000])

    def artifacts(self, folder: Path) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path="report")

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


class Wandb:
    """A W&B run (offline by default: its files under `dir/wandb`); its id continues it."""

    kind = "wandb"

    def __init__(self, settings) -> None:
        self.settings = settings
        self.destination = f"{settings.entity or ''}/{settings.project}"
        self.run = None

    def start(self, run: str, params: dict[str, Any], external_id: str | None) -> str:
        for name, value in (("WANDB_ERROR_REPORTING", "false"), ("WANDB_SILENT", "true"),
                            ("WANDB_DISABLE_GIT", "true"), ("WANDB_CONSOLE", "off")):
            os.environ.setdefault(name, value)
        if self.settings.mode == "offline":
            os.environ["WANDB_MODE"] = "offline"  # before wandb starts: no telemetry lookups
        import wandb

        folder = Path(self.settings.dir or ".").resolve()  # wandb writes folder/wandb/
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.settings.project, entity=self.settings.entity,
                              mode=self.settings.mode, dir=str(folder), name=run,
                              id=external_id, resume="allow", config=params)
        return self.run.id

    def last_logged(self) -> int:
        return -1  # W&B merges a step logged twice into one row

    def log(self, step: int, scalars: dict[str, float], stage: str | None,
            samples: list[dict] | None = None) -> None:
        values: dict[str, Any] = {**scalars, "stage": stage or ""}
        if samples:
            import wandb

            values["samples"] = wandb.Table(columns=list(samples[0]),
                                            data=[list(row.values()) for row in samples])
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass  # W&B sends each step as it is logged

    def artifacts(self, folder: Path) -> None:
        import wandb

        report = wandb.Artifact(f"{self.run.name}-report", type="report")
        report.add_dir(str(folder))
        self.run.log_artifact(report)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (TensorBoard's text plugin renders it)."""
    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return " ".join(text.split()).replace("|", "\\|")[:500]
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def configured(tracking) -> list:
    """The trackers a config's `tracking:` section names (none imported yet)."""
    return [kind(settings) for kind, settings in ((TensorBoard, tracking.tensorboard),
                                                   (Mlflow, tracking.mlflow),
                                                   (Wandb, tracking.wandb)) if settings]
