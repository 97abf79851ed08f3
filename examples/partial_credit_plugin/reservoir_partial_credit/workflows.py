"""A workflow with a second attempt: the model answers; when the reward says it is not fully
right, the user asks it to try again, and the episode (both attempts, the request between them
with mask 0) is scored by its last answer."""


def second_try(task, policy, retry_below: float = 1.0):
    episodes = [policy.episode(task.prompt) for _ in range(policy.n)]
    answers = policy.reply(episodes)
    again = [i for i, text in enumerate(answers)
             if policy.score(text, task.answer)[0] < retry_below and not episodes[i].truncated]
    for i in again:
        episodes[i].add("user", "Not quite. Try again.")
    for i, text in zip(again, policy.reply([episodes[i] for i in again])):
        answers[i] = text
    return [episode.experience(*policy.score(text, task.answer),
                               metadata={"attempts": episode.turns})
            for episode, text in zip(episodes, answers)]
