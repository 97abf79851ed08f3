"""`reservoir demo store`: the store quickstart with synthetic rollouts.

Creates a run, loads addition tasks, writes groups of synthetic responses (character token ids,
made-up logprobs, exact-match reward), then leases, commits and publishes a few train steps the
way a trainer would. Everything it leaves behind is plain rows to query with `reservoir sql`.
"""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.progress import Progress
from reservoir.store import Experience, Store


def char_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)


def synthetic_group(rng: np.random.Generator, run: str, task_id: int, a: int, b: int,
                    size: int, version: int) -> list[Experience]:
    prompt = f"What is {a} + {b}? Answer with the number."
    group = []
    for _ in range(size):
        guess = a + b if rng.random() < 0.4 else a + b + int(rng.integers(-9, 10))
        response = f"The answer is {guess}."
        n = len(response)
        correct = float(guess == a + b)
        group.append(Experience(
            run=run, task_id=task_id, policy_version=version, prompt_text=prompt,
            response_text=response, prompt_ids=char_ids(prompt), response_ids=char_ids(response),
            logprobs=-rng.exponential(0.5, n).astype(np.float32), action_mask=np.ones(n, np.uint8),
            reward=correct, reward_components={"accuracy": correct}, metadata={"a": a, "b": b}))
    return group


def run_demo(store: Store, *, run: str, n_groups: int, group_size: int, steps: int,
             groups_per_step: int, seed: int, console: Console, raw_groups: int = 0) -> None:
    rng = np.random.default_rng(seed)
    store.runs.delete_run(run)
    run_id = store.create_run(run, group_size=group_size, model="synthetic",
                              config={"demo": "store", "seed": seed})
    pairs = rng.integers(0, 100, size=(n_groups, 2))
    task_ids = store.tasks.add_tasks(run_id, [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b), "source": "demo"}
        for a, b in pairs])
    store.publish_version(run, 0, location="synthetic://v0", train_step=0)
    with Progress(console=console, transient=True) as progress:
        writing = progress.add_task("writing groups", total=n_groups)
        for start in range(0, n_groups, 100):
            batch = [synthetic_group(rng, run, task_ids[i], int(a), int(b), group_size, 0)
                     for i, (a, b) in enumerate(pairs[start:start + 100], start)]
            store.write_groups(batch)
            progress.advance(writing, len(batch))
        training = progress.add_task("leasing and committing steps", total=steps)
        for step in range(1, steps + 1):
            lease = store.lease(run, groups=groups_per_step)
            rewards = [row.reward for row in lease.rows]
            store.commit_step(lease, step=step, policy_version=step - 1,
                              loss=float(-np.mean(rewards)),
                              metrics={"reward_mean": float(np.mean(rewards))})
            store.publish_version(run, step, location=f"synthetic://v{step}", train_step=step)
            progress.advance(training)
        if raw_groups:  # new rows no pipeline has looked at yet
            store.write_groups([synthetic_group(rng, run, task_ids[i % n_groups],
                                                int(pairs[i % n_groups][0]),
                                                int(pairs[i % n_groups][1]), group_size, steps)
                                for i in range(raw_groups)], status="raw")
    console.print(f"[bold green]run {run!r}:[/] {n_groups} groups of {group_size} written, "
                  f"{steps} steps of {groups_per_step} groups trained and published"
                  + (f", {raw_groups} raw groups waiting for a pipeline." if raw_groups else "."))
