"""An environment of its own: guess a number from 1 to 8 with "higher"/"lower" feedback.

    python -m jaxrl_agentic.train --config docs/examples/custom_environment.py

A host-side (Python) environment: one object per episode, `reset(seed)` gives the first
user message, `step(reply)` a `PyStep` (envs/python_env.py). Registered with
`backend="python"`, so a run plays it on the thread-pool runner by itself
(`env_backend="auto"`). Reward 1 for the right number; a reply without
`<answer>N</answer>` costs the format penalty. A binary search solves any number in 3
guesses, so the task rewards reading the feedback.
"""

import random

from jaxrl_agentic.config import default_config, env_manager, env_spec
from jaxrl_agentic.envs import register
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash
from jaxrl_agentic.envs.tools import parse_answer


class GuessTheNumber(PythonTextEnv):
    max_steps_in_episode = 4

    def __init__(self, run_seed: int, format_penalty: float):
        self.run_seed, self.format_penalty = run_seed, format_penalty
        self.secret, self.guesses = 0, []

    def reset(self, seed: int) -> str:
        # The same number for every member of a group (same seed), another per run seed.
        self.secret = random.Random(f"guess:{self.run_seed}:{seed}").randint(1, 8)
        self.guesses = []
        return ("Guess the number from 1 to 8. After each guess you are told 'higher' or "
                "'lower'. Reply <answer>N</answer>.")

    def step(self, reply: str) -> PyStep:
        given = parse_answer(reply)
        if given is None or not given.isdigit() or not 1 <= int(given) <= 8:
            return PyStep(observation="Reply <answer>N</answer> with N from 1 to 8.",
                          reward=-self.format_penalty, terminated=False, action_is_valid=False,
                          action_is_effective=False, success=False)
        guess = int(given)
        self.guesses.append(guess)
        right = guess == self.secret
        hint = "right" if right else ("higher" if self.secret > guess else "lower")
        return PyStep(observation=f"{guess}: {hint}.", reward=float(right), terminated=right,
                      action_is_valid=True, action_is_effective=True, success=right,
                      action=guess - 1)

    def state_hash(self) -> bytes:
        return text_state_hash(f"{self.secret}:{self.guesses}")


def guess_the_number(*, format_penalty: float = 0.1):
    """The factory builder: config → (episode spec, run seed) → one env per episode."""
    def factory(spec, run_seed: int) -> GuessTheNumber:
        return GuessTheNumber(run_seed, format_penalty)

    return factory


# replace=True: a config file may be loaded more than once in a process.
register("guess_the_number", guess_the_number, backend="python", replace=True)


def get_config():
    c = default_config()
    c.exp_name = "guess_the_number"
    c.pretrain = "tiny"
    c.adv_estimator = "grpo"
    c.format_warmup.steps = 0  # no scripted policy for this env: RL from the start
    c.max_input_length = 256
    c.sequence_length = 320
    c.micro_batch_max_tokens = 640
    c.custom_envs = {"guess": env_spec("guess_the_number", max_turns=4, max_tokens_per_step=8,
                                       format_penalty=0.1)}
    c.train_env_manager = env_manager(num_env_groups=8, group_size=4, tags=("guess",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("guess",))
    return c
