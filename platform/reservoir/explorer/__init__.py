"""The explorer: inference engines, workflows, reward functions, task generators, worker pool."""
