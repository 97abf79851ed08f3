"""Experiment trackers (TensorBoard, MLflow, W&B) that follow a run's committed steps from the
store: `follow(config, store)` while a trainer runs, `replay(...)` for `reservoir runs track`."""

from reservoir.tracking.follow import follow, replay

__all__ = ["follow", "replay"]
