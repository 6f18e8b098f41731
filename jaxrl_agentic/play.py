"""Play a text environment turn by turn: `python -m jaxrl_agentic.play --env frozen_lake`.

Every turn shows the prompt (the instructions and the board on the first turn, the board
afterwards), reads one reply line from stdin, and prints the parsed action, the reward and
whether the episode is done; a final `metrics:` line sums the episode up. A bare action
name such as `left` is accepted too: a line without an `<answer>` tag is wrapped in one.
End of input ends the episode early (still with the metrics line).

The loop only talks to a `policy(prompt_text) -> reply_text` callable, so a model can play
in place of a person; a policy raises EOFError when it has nothing more to say.
"""

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import TextIO

import jax

from jaxrl_agentic.envs import INVALID_ACTION, episode_metrics, make
from jaxrl_agentic.envs.base import TextEnvironment, TextEnvParams

Policy = Callable[[str], str]


# step_env, not step: gymnax's step would auto-reset and hide the final board. Jitted at
# module level (env static) so that episodes after the first reuse the compiled step.
@partial(jax.jit, static_argnums=0)
def _step_env(env: TextEnvironment, key, state, action, params):
    return env.step_env(key, state, action, params)


def stdin_policy(stdin: TextIO, stdout: TextIO) -> Policy:
    """A policy that asks a person: one line of `stdin` per turn; EOFError at end of input."""

    def policy(prompt: str) -> str:
        del prompt  # already printed by the loop
        stdout.write("reply> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            raise EOFError
        if not stdin.isatty():
            stdout.write(line if line.endswith("\n") else line + "\n")  # piped input: echo it
        reply = line.strip()
        return reply if "<answer>" in reply.lower() else f"<answer>{reply}</answer>"

    return policy


def play_episode(
    env: TextEnvironment,
    params: TextEnvParams,
    policy: Policy,
    key: jax.Array,
    out: TextIO,
    max_turns: int | None = None,
) -> dict[str, float]:
    """Run one episode with `policy`, narrating to `out`; returns `episode_metrics`."""
    key, reset_key = jax.random.split(key)
    _, state = env.reset(reset_key, params)
    rewards, infos = [], []
    prompt = f"{env.instructions(params)}\n\n{env.render_text(state, params)}"
    turn = 0
    while max_turns is None or turn < max_turns:
        turn += 1
        print(f"--- turn {turn} ---\n{prompt}", file=out)
        try:
            reply = policy(prompt)
        except EOFError:
            print("\n(end of input)", file=out)
            break
        action = env.parse_action(reply)
        key, step_key = jax.random.split(key)
        chosen = INVALID_ACTION if action is None else action
        _, state, reward, terminated, info = _step_env(env, step_key, state, chosen, params)
        done = bool(terminated) or bool(env.is_truncated(state, params))
        rewards.append(float(reward))
        infos.append(jax.device_get(info))
        name = "none (no valid action: format penalty)"
        if action is not None:
            name = env.action_names[action]
        print(f"action: {name}\nreward: {float(reward):g}  done: {done}", file=out)
        prompt = env.render_text(state, params)
        if done:
            print(f"--- final state ---\n{prompt}", file=out)
            break
    metrics = episode_metrics(rewards, infos)
    print("metrics: " + " ".join(f"{k}={v:g}" for k, v in metrics.items()), file=out)
    return metrics


def main(argv: list[str] | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> int:
    """The command line (see module doc); returns the exit status."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    parser = argparse.ArgumentParser(prog="python -m jaxrl_agentic.play", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="frozen_lake", help="registered name or gymnax:<id>")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the episode")
    parser.add_argument("--max-turns", type=int, default=None,
                        help="stop after this many turns (default: until the episode ends)")
    args = parser.parse_args(argv)
    try:
        env, params = make(args.env)
    except ValueError as error:
        parser.error(str(error))
    play_episode(env, params, stdin_policy(stdin, stdout), jax.random.key(args.seed), stdout,
                 max_turns=args.max_turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
