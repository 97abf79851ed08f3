"""The names of the task generators a config may name (`tasks.generator`); the generators
themselves live with the explorer's environments (`reservoir.explorer.tasks.GENERATORS`, whose
keys are exactly these: tests/test_tasks.py checks)."""

GENERATOR_NAMES = ("addition", "reverse", "sort", "calculator", "guess_number")
