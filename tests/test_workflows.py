"""Workflows on a tiny local model and the real store: a multi-turn episode's tool tokens carry
mask 0 and get no gradient while the model's tokens do; the calculator and guess-the-number
environments; sft on demonstrations; the batcher's ordering; workflow options."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from openai.types.chat import ChatCompletion

from reservoir.chat import demonstration, encode
from reservoir.errors import ConfigError, WorkflowError
from reservoir.explorer.batcher import Batcher
from reservoir.explorer.engine import Request, TransformersEngine
from reservoir.explorer.guess import feedback
from reservoir.explorer.policy import Policy, Sampling
from reservoir.explorer.rewards import REWARDS, exact_match
from reservoir.explorer.tools import calculate
from reservoir.explorer.workflow import Task, explore, make_workflow
from reservoir.models import build_tiny_model, load_model
from reservoir.plan.tasks import binary_search, calculator_tasks, guess_number_tasks
from reservoir.store import Experience
from reservoir.trainer.batch import make_batch
from reservoir.trainer.sft import conversation, demonstrations, sft_batch
from reservoir.trainer.step import PRESETS, train_step


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_path):
    return TransformersEngine(model_path)


@pytest.fixture(scope="module")
def calc_engine(model_path):
    """The tiny model after a short sft on calculator demonstrations: it ends its turns."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_path)
    conversations = [row["payload"]["messages"] for row in calculator_tasks(384, seed=0)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(120):
        start = (step * 32) % len(conversations)
        batch = sft_batch(tokenizer.pad_token_id,
                          demonstrations(tokenizer, conversations[start:start + 32]))
        train_step(model, optimizer, batch, PRESETS["sft"], micro_batch=32)
    return TransformersEngine.of(model.eval(), tokenizer)


def policy_of(batcher, *, n=2, max_tokens=6, run="r", task_id=None, version=0):
    return Policy(batcher, Sampling(n, 1.0, max_tokens), exact_match, run, task_id, version)


def tool_episode(policy):
    """reply, tool answer, reply: a real two-turn episode whatever the model writes."""
    episode = policy.episode("Compute 12*34")
    episode.reply()
    episode.add("tool", "408")
    episode.reply()
    return episode


@pytest.mark.slow
def test_an_episode_holds_model_turns_with_mask_1_and_tool_turns_with_mask_0(calc_engine):
    torch.manual_seed(0)
    with Batcher(calc_engine) as batcher:
        episode = tool_episode(policy_of(batcher, max_tokens=30))
    tokenizer, tokens = calc_engine.tokenizer, episode.tokens
    mask = np.asarray(tokens.mask)
    tool = encode(tokenizer, "<|tool|>408<|end|><|assistant|>")
    starts = [i for i in range(len(mask)) if tokens.response_ids[i:i + len(tool)] == tool]
    assert len(starts) == 1 and episode.turns == 2
    start = starts[0]
    assert mask[start:start + len(tool)].tolist() == [0] * len(tool)  # the tool turn
    assert mask[:start].all() and mask[start + len(tool):].all()      # the model's turns
    assert tokens.response_ids[start - 1] == tokenizer.eos_token_id   # turn one ended itself
    logprobs = np.asarray(tokens.logprobs)
    assert (logprobs[mask == 0] == 0).all() and (logprobs[mask == 1] < 0).all()
    experience = episode.experience(1.0, {"accuracy": 1.0})
    assert experience.response_text.count("<|tool|>408") == 1
    assert experience.metadata == {"turns": 2, "truncated": episode.truncated}


def logit_gradients(model, batch):
    """d loss / d logits of one real train step, observed by a hook on the output layer."""
    captured = []
    head = model.get_output_embeddings()

    def keep_gradient(module, args, output) -> None:
        output.register_hook(captured.append)

    handle = head.register_forward_hook(keep_gradient)
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=len(batch))
    finally:
        handle.remove()
    (grad,) = captured
    return grad[:, :-1].abs().sum(-1)  # position t predicts token t + 1, as batch.mask


def test_tool_tokens_get_no_gradient_and_model_tokens_do(calc_engine, store):
    store.create_run("r")
    torch.manual_seed(1)
    with Batcher(calc_engine) as batcher:
        policy = policy_of(batcher, max_tokens=30)
        group = [tool_episode(policy).experience(reward) for reward in (1.0, 0.0)]
    assert all(0 in row.action_mask for row in group)
    store.write_groups([group])
    rows = sorted(store.lease("r", groups=1).rows, key=lambda row: row.id)
    model = copy.deepcopy(calc_engine.model).train()
    batch = make_batch(rows, calc_engine.tokenizer.pad_token_id)
    grad = logit_gradients(model, batch)
    mask = batch.mask.bool()
    prompt_len = len(rows[0].prompt_ids)
    tool = torch.zeros_like(mask)
    for i, row in enumerate(rows):
        zeros = np.flatnonzero(row.action_mask == 0)
        tool[i, prompt_len - 1 + zeros] = True
    assert tool.sum() > 0 and (grad[tool] == 0).all()      # tool tokens: no gradient at all
    assert (grad[mask] > 0).all()                           # every model token: some
    assert torch.isnan(batch.old_logprobs[tool]).all()      # and no logprob to compare with
    assert not torch.isnan(batch.old_logprobs[mask]).any()


def test_sft_on_a_demonstration_trains_only_the_assistant_turns(engine):
    messages = calculator_tasks(1, seed=3)[0]["payload"]["messages"]
    tokens = demonstration(engine.tokenizer, messages)
    decoded = [engine.tokenizer.decode([t]) for t in tokens.response_ids]
    trained = "".join(d for d, m in zip(decoded, tokens.mask) if m)
    call, result = messages[1]["content"], messages[2]["content"]
    assert trained == f"{call}<|end|>{result}<|end|>"
    batch = sft_batch(engine.tokenizer.pad_token_id, demonstrations(
        engine.tokenizer, [messages, conversation("Reverse: ab", "ba")]))
    assert batch.mask.sum(1).tolist() == [len(call) + len(result) + 2, 3.0]


def test_calculator_refuses_anything_but_arithmetic():
    assert calculate("(10 + 5) * 3 - 7") == "38"
    assert calculate("7 / 2") == "3.5" and calculate("-(2 ** 10)") == "-1024"
    for hostile in ("__import__('os').system('true')", "().__class__", "9 ** 9 ** 9",
                    "1e308 * 10", "x + 1", "1 / 0", "[1] * 3", ""):
        assert calculate(hostile).startswith("error:"), hostile


def test_the_calculator_workflow_calls_the_tool_after_a_short_sft(calc_engine, store):
    store.create_run("calc")
    tasks = [Task(None, row["prompt"], row["answer"]) for row in calculator_tasks(6, seed=9)]
    torch.manual_seed(3)
    with Batcher(calc_engine) as batcher:
        groups = explore(make_workflow("calculator", {"max_calls": 1}), tasks, batcher,
                         Sampling(2, 1.0, 12), run="calc", version=0, reward="exact_match")
    store.write_groups(groups)
    episodes = [row for group in groups for row in group]
    called = [row for row in episodes if row.metadata["tool_calls"] == 1]
    assert len(called) >= len(episodes) // 2, [row.response_text for row in episodes]
    for row in called:  # the tool's answer is the calculator's, on what the model wrote
        text = row.response_text
        expression = text.split("CALC", 1)[1].split("<|end|>", 1)[0]
        assert f"<|tool|>{calculate(expression)}<|end|>" in text
        assert 0 in row.action_mask and row.action_mask[0] == 1


def test_guess_number_gives_feedback_until_found():
    assert binary_search(11, 1, 16) == [
        {"role": "assistant", "content": "8"}, {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "12"}, {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "10"}, {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "11"}]
    assert feedback("maybe 3?", 3) == "correct"
    row = guess_number_tasks(5, seed=1)[0]
    assert row["answer"] == str(row["payload"]["secret"])


def test_the_generated_demonstrations_say_what_the_environments_say():
    """The task generators live in reservoir.plan (issue 31), the environments in the
    explorer: a calculator demonstration's result is the calculator's, and a binary search's
    answers are the guessing game's feedback."""
    for row in calculator_tasks(200, seed=5):
        call, result, answer = (m["content"] for m in row["payload"]["messages"][1:])
        assert result == answer == row["answer"] == calculate(call.removeprefix("CALC "))
    for row in guess_number_tasks(200, seed=6, low=1, high=40):
        messages, secret = row["payload"]["messages"][1:], row["payload"]["secret"]
        for guess, said in zip(messages[::2], [*messages[1::2], {"content": "correct"}]):
            assert feedback(guess["content"], secret) == said["content"]


def test_guess_number_episodes_end_after_max_turns(engine):
    task = Task.of((None, "Guess my number from 1 to 16", "5", {"secret": 5}))
    torch.manual_seed(2)
    with Batcher(engine) as batcher:
        (group,) = explore(make_workflow("guess_number", {"max_turns": 3}), [task], batcher,
                           Sampling(3, 1.0, 4), run="r", version=0, reward="exact_match")
    for row in group:
        assert 1 <= row.metadata["turns"] <= 3 and row.metadata["secret"] == 5
        assert row.reward == sum(row.reward_components.values())
        turns_found = row.response_text.count("<|user|>")
        assert turns_found == row.metadata["turns"] - 1 or row.reward_components["accuracy"]


def test_a_batch_holds_every_waiting_caller_in_their_order(engine):
    seen = []

    class Recording:
        tokenizer, context = engine.tokenizer, engine.context

        def generate(self, requests, seed=None):
            seen.append([request.max_tokens for request in requests])
            return engine.generate(requests)

    with Batcher(Recording(), max_wait_s=30) as batcher:
        batcher.join(5)
        prompt = encode(engine.tokenizer, "<|user|>hi<|end|><|assistant|>")

        def call(index):
            try:
                batcher.generate([Request(prompt, 1, 1.0, index + 1)], order=(index,))
            finally:
                batcher.leave()

        threads = [threading.Thread(target=call, args=(i,)) for i in reversed(range(5))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert seen == [[1, 2, 3, 4, 5]]  # one engine call, in order, however the threads ran


def test_workflow_options_and_failures_are_named(engine):
    with pytest.raises(ConfigError, match="explorer.workflow_options: workflow 'calculator' "
                                          "does not take them"):
        make_workflow("calculator", {"max_cals": 2})
    for bad in (1e20, True, -1, "2"):
        with pytest.raises(ConfigError, match="explorer.workflow_options: workflow "
                                              "'calculator': max_calls = .*: a whole number"):
            make_workflow("calculator", {"max_calls": bad})
    with pytest.raises(ConfigError, match="unknown workflow 'nope'; valid: calculator, "
                                          "guess_number, single_turn"):
        make_workflow("nope")
    with Batcher(engine) as batcher:
        with pytest.raises(WorkflowError, match="workflow 'guess_number' failed on task 7: "
                                                "KeyError: 'secret'"):
            explore(make_workflow("guess_number"), [Task(7, "Guess", "1")], batcher,
                    Sampling(1, 1.0, 4), run="r", version=0, reward="exact_match")
        with pytest.raises(WorkflowError, match="names run 'other'"):
            explore(other_run, [Task(None, "p")], batcher, Sampling(1, 1.0, 2), run="r",
                    version=0, reward="exact_match")


def other_run(task, policy):
    return [Experience(run="other", task_id=task.id, prompt_text="p", response_text="x",
                       prompt_ids=[1], response_ids=[2], reward=0.0)]


def agent_workflow(task, policy):
    """Agent code written against the openai client, given the policy's client instead."""
    client = policy.client()
    first = client.chat.completions.create(
        model="anything", n=2, logprobs=True,
        messages=[{"role": "user", "content": task.prompt}])
    assert isinstance(first, ChatCompletion)
    client.chat.completions.create(model="anything", max_tokens=3, messages=[
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "again"}])
    group = client.group(rewards=[1.0, 0.0, 0.5])
    for row, choice in zip(group, first.choices):
        sent = [token.logprob for token in choice.logprobs.content]
        np.testing.assert_allclose(row.logprobs, sent)
    return group


def test_agent_code_runs_on_the_policy_s_openai_style_client(engine, store):
    store.create_run("agent")
    with Batcher(engine) as batcher:
        (group,) = explore(agent_workflow, [Task(None, "Reverse: ab", "ba")], batcher,
                           Sampling(2, 1.0, 5), run="agent", version=0, reward="exact_match")
        with pytest.raises(WorkflowError, match="temperature: this run samples at 1"):
            explore(lambda task, policy: policy.client().chat.completions.create(
                        model="m", temperature=0.2, messages=[{"role": "user", "content": "x"}]),
                    [Task(None, "x")], batcher, Sampling(1, 1.0, 2), run="agent", version=0,
                    reward="exact_match")
    assert [row.reward for row in group] == [1.0, 0.0, 0.5]
    assert len({row.group_id for row in group}) == 1
    assert [row.metadata["choice"] for row in group] == [0, 1, 0]
    assert all(row.action_mask.all() for row in group)
    assert store.write_groups([group]).rows == 3


@pytest.mark.parametrize("inline", [True, False])
def test_single_turn_runs_a_round_in_one_call_with_the_samples_of_a_thread_per_task(
        engine, inline):
    """single_turn's round (one engine call on the exploring thread, no thread per task) gives
    each task the samples, rewards and order a thread per task gives, under the same seed, on
    an inline batcher and on one with a thread of its own."""
    tasks = [Task(i, f"Reverse: {word}", word[::-1]) for i, word in
             enumerate(["ab", "cde", "fg", "hij", "k", "lmno", "pq", "rs", "tuv"])]
    by_thread = make_workflow("single_turn")
    by_thread = type(by_thread)(by_thread.name, by_thread.function)  # the same, without round
    assert make_workflow("single_turn").round is not None and by_thread.round is None
    found = []
    for workflow in (make_workflow("single_turn"), by_thread):
        torch.manual_seed(3)
        with Batcher(engine, inline=inline) as batcher:
            groups = explore(workflow, tasks, batcher, Sampling(4, 1.0, 6), run="r",
                             version=2, reward="exact_match")
        found.append([[(row.task_id, row.response_ids.tolist(), row.reward) for row in group]
                      for group in groups])
    assert found[0] == found[1] and len(found[0]) == len(tasks)
    assert [group[0][0] for group in found[0]] == list(range(len(tasks)))


def test_a_round_that_breaks_its_contract_is_named(engine):
    def round_of_one(tasks, policies):
        return [[]]

    broken = make_workflow("single_turn")
    broken = type(broken)("mine", broken.function, round_of_one)
    with Batcher(engine, inline=True) as batcher:
        with pytest.raises(WorkflowError, match="workflow 'mine': its round returned 1 groups "
                                                "for 2 tasks"):
            explore(broken, [Task(1, "p"), Task(2, "q")], batcher, Sampling(1, 1.0, 2),
                    run="r", version=0, reward="exact_match")


SCORED = threading.Event()


@REWARDS.register("test_marks_it_scored")
def marks_it_scored(response: str, answer: str) -> dict:
    SCORED.set()
    return {"accuracy": 0.0}


def test_single_turn_scores_a_task_while_the_engine_generates_the_next(model_path):
    """A round's first tasks are scored on a thread of their own while the engine is still
    generating: the engine's last chunk waits (up to 60 s) for a task to have been scored, which
    scoring after the whole round could never give it."""
    class Watching(TransformersEngine):
        waited_for_scoring = None

        def _sample_chunk(self, prompts, temperature, max_tokens):
            if self.chunks_left == 1:
                Watching.waited_for_scoring = SCORED.wait(60)
            self.chunks_left -= 1
            return super()._sample_chunk(prompts, temperature, max_tokens)

    engine = Watching(model_path, batch_size=4)  # 4 rows: one task of n 4 a chunk
    engine.chunks_left = 3
    SCORED.clear()
    tasks = [Task(i, f"Reverse: {word}", word[::-1], {"reward": "test_marks_it_scored"})
             for i, word in enumerate(["ab", "cd", "ef"])]
    with Batcher(engine, inline=True) as batcher:
        groups = explore(make_workflow("single_turn"), tasks, batcher, Sampling(4, 1.0, 4),
                         run="r", version=0, reward="exact_match")
    assert Watching.waited_for_scoring is True and [len(group) for group in groups] == [4] * 3
