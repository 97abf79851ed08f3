"""An agent that knows nothing of Reservoir but its endpoint: it asks the served model to
reverse words (8 answers per word, one episode each word), scores each answer itself and
reports the rewards; Reservoir records the calls and trains on the reported episodes.

    python examples/served_agent/agent.py --base-url http://127.0.0.1:8000/v1 --episodes 700
"""

from __future__ import annotations

import argparse
import random
import string
import time

from openai import OpenAI

from reservoir.agent import Episode, wait_for_policy


def word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="served-agent")
    parser.add_argument("--episodes", type=int, default=700)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    print(f"serving policy version {wait_for_policy(args.base_url)}", flush=True)
    rng, window = random.Random(args.seed), []
    for episode in range(args.episodes):
        secret = word(rng)
        calls = Episode(client, f"agent-{args.seed}-{episode}")
        reply = calls.create(model=args.model, n=8,
                             messages=[{"role": "user", "content": f"Reverse: {secret}"}])
        rewards = [float(choice.message.content.strip() == secret[::-1])
                   for choice in reply.choices]
        calls.report(rewards=rewards)
        window.append(sum(rewards) / len(rewards))
        if len(window) == 50:
            print(f"{time.strftime('%H:%M:%S')} episodes {episode - 48}..{episode + 1}: mean "
                  f"reward {sum(window) / 50:.3f} (policy version {reply.system_fingerprint})",
                  flush=True)
            window.clear()


if __name__ == "__main__":
    main()
