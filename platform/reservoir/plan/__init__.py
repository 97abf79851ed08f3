"""A run's plan: its stages, the algorithm presets they name, the task generators' names and
database URLs. No torch, no store: config, explorer, trainer and pool all read it from below."""
