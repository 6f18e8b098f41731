"""Play a text environment turn by turn: `python -m jaxrl_agentic.play --env frozen_lake`.

Every turn shows the prompt (the instructions and the board on the first turn, the board
afterwards), reads one reply line from stdin, and prints the parsed action, the reward and
whether the episode is done; a final `metrics:` line sums the episode up. A bare action
name such as `left` is accepted too: a line without an `<answer>` tag is wrapped in one.
End of input ends the episode early (still with the metrics line).

The loop only talks to a `policy(prompt_text) -> reply_text` callable, so a model can play
in place of a person; a policy raises EOFError when it has nothing more to say.

A model must see the prompts it was trained on: `--config configs/<recipe>.py` takes the
environment (its params, format penalty), the reply prefix/suffix and the reply length from
the recipe (`--env` then picks one of its env tags). `--model` without `--config` plays the
default recipe's environment (`configs/frozen_lake.py`, what `train` runs by default); a
person without `--config` plays the environment's defaults (full instructions). An
environment a recipe registers (docs/extending.md) exists once its recipe is loaded: play
it with `--config <recipe> [--env <tag>]`.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import TextIO

import jax

from jaxrl_agentic.envs import INVALID_ACTION, episode_metrics, make
from jaxrl_agentic.envs.base import TextEnvironment, TextEnvParams
from jaxrl_agentic.envs.messages import feedback_message, first_message

Policy = Callable[[str], str]
DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "frozen_lake.py")


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
        if "<answer>" in reply.lower() or "<tool_call>" in reply:  # a tool call goes as typed
            return reply
        return f"<answer>{reply}</answer>"

    return policy


def model_policy(model_dir: str, stdout: TextIO, *, max_new_tokens: int = 64,
                 temperature: float = 1.0, greedy: bool = False, seed: int = 0,
                 max_total_len: int = 4096, reply_prefix: str = "",
                 reply_suffix: str = "", tools: list | None = None) -> Policy:
    """A policy where a model replies, over one token-level conversation (prefix reuse).
    `model_dir`: a Hugging Face directory, "tiny" / "tiny-tools", or a training run (its
    output directory, checkpoints directory or one step's: the policy at that checkpoint).
    `reply_prefix`, `reply_suffix`: as in training (the config fields of those names).
    `tools` (a tool environment's schemas) are listed in the first prompt, and a prompt of
    `<tool_response>` blocks is sent as `tool` messages, as in training."""
    from jaxrl_agentic.envs.tools import tool_responses
    from jaxrl_agentic.models import load_pretrained
    from jaxrl_agentic.models.tiny import pretrained_dir
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.run_loading import run_policy
    from jaxrl_agentic.run_paths import is_run_path
    from jaxrl_agentic.sampling import Sampler

    builtin = pretrained_dir(model_dir)
    if builtin is None and is_run_path(model_dir):  # a training run: its checkpoint's policy
        model, tokenizer = run_policy(model_dir)
    else:
        model, tokenizer = load_pretrained(builtin or model_dir)
    formatter = ChatFormatter(tokenizer, reply_prefix=reply_prefix, reply_suffix=reply_suffix)
    session = Sampler(model, tokenizer, max_total_len=max_total_len).new_session(1)
    turn = [0]

    def policy(prompt: str) -> str:
        results = tool_responses(prompt) if tools else []
        if turn[0] == 0:
            ids = formatter.first_prompt(prompt, tools=tools)
        elif results:
            ids = formatter.tool_prompt(results)
        else:
            ids = formatter.next_prompt(prompt)
        session.extend([0], [ids])
        out = session.generate([0], max_new_tokens=max_new_tokens, temperature=temperature,
                               greedy=greedy, seed=seed + turn[0])
        if out.stop_reasons[0] != "eos":  # close the reply so the next prompt follows EOS
            session.extend([0], [[formatter.eos_token_id]])
        turn[0] += 1
        reply = formatter.decode_reply(out.tokens[0])
        print(f"model: {reply}", file=stdout)
        return reply

    return policy


def _ask(policy: Policy, prompt: str, turn: int, out: TextIO) -> str | None:
    """Shows turn `turn`'s prompt and returns the policy's reply (None at end of input)."""
    print(f"--- turn {turn} ---\n{prompt}", file=out)
    try:
        return policy(prompt)
    except EOFError:
        print("\n(end of input)", file=out)
        return None


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
    # The same messages the training rollout sends, so a trained model sees its own format.
    prompt = first_message(env, state, params)
    turn = 0
    while max_turns is None or turn < max_turns:
        turn += 1
        reply = _ask(policy, prompt, turn, out)
        if reply is None:
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
        if done:
            print(f"--- final state ---\n{env.render_text(state, params)}", file=out)
            break
        prompt = feedback_message(env, state, params, float(reward), chosen)
    metrics = episode_metrics(rewards, infos)
    print("metrics: " + " ".join(f"{k}={v:g}" for k, v in metrics.items()), file=out)
    return metrics


def play_python_episode(env, policy: Policy, seed: int, out: TextIO,
                        max_turns: int | None = None) -> dict[str, float]:
    """One episode of a Python (e.g. tool) environment, narrated to `out`; the results of
    tool calls are shown, and passed to the policy, as `<tool_response>` blocks."""
    from jaxrl_agentic.envs.tools import TOOL_METRICS, tool_episode_metrics, tool_response_text

    prompt = env.reset(seed)
    if env.tool_schemas:
        print("tools:\n" + "\n".join(json.dumps(t) for t in env.tool_schemas), file=out)
    steps, turn = [], 0
    limit = env.max_steps_in_episode if max_turns is None else max_turns
    while turn < limit:
        turn += 1
        reply = _ask(policy, prompt, turn, out)
        if reply is None:
            break
        step = env.step(reply)
        steps.append(step)
        print(f"reward: {step.reward:g}  done: {step.terminated}", file=out)
        if step.terminated:
            break
        prompt = (tool_response_text(step.tool_messages) if step.tool_messages
                  else step.observation)
    metrics = episode_metrics([s.reward for s in steps],
                              [{"action_is_valid": s.action_is_valid,
                                "action_is_effective": s.action_is_effective,
                                "success": s.success} for s in steps])
    if env.tool_schemas:
        metrics.update({k: v for k, v in tool_episode_metrics(steps).items()
                        if k in TOOL_METRICS})
    print("metrics: " + " ".join(f"{k}={v:g}" for k, v in metrics.items()), file=out)
    return metrics


def recipe_env(path: str, tag: str | None):
    """(EnvSettings, reply_prefix, reply_suffix) of env tag `tag` (default: the first) of
    the recipe at `path`; ValueError (one line) for a bad recipe or tag."""
    from jaxrl_agentic.config import ConfigError, validate
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.train import parse_config

    try:
        c = parse_config(["play", f"--config={path}"])
        validate(c)
    except ConfigError as error:
        raise ValueError(f"--config {path}: {error}") from None
    cfg = build_run_config(c)
    tags = list(cfg.envs)
    tag = tags[0] if tag is None else tag
    if tag not in tags:
        raise ValueError(f"--env {tag!r} is not an env tag of {path}; its tags: "
                         f"{', '.join(tags)}")
    return cfg.envs[tag], cfg.rollout.reply_prefix, cfg.rollout.reply_suffix


def main(argv: list[str] | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> int:
    """The command line (see module doc); returns the exit status."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    parser = argparse.ArgumentParser(prog="python -m jaxrl_agentic.play", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default=None,
                        help="registered name or gymnax:<id>; with --config, one of the "
                             "recipe's env tags (default: frozen_lake / the recipe's first)")
    parser.add_argument("--config", default=None,
                        help="a recipe (configs/*.py): play its env with its prompt format "
                             "(default with --model: configs/frozen_lake.py)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the episode")
    parser.add_argument("--max-turns", type=int, default=None,
                        help="stop after this many turns (default: until the episode ends)")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model directory, 'tiny', or a training run's "
                             "output directory (its latest checkpoint) that plays instead")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="reply length (default: the recipe's max_tokens_per_step, or 64)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--reply-prefix", default=None,
                        help="text every reply starts with (default: the recipe's, or none)")
    parser.add_argument("--reply-suffix", default=None,
                        help="text appended to every reply for the parser (default: the "
                             "recipe's, or none)")
    args = parser.parse_args(argv)
    from jaxrl_agentic.envs.python_env import make_python_env
    from jaxrl_agentic.envs.registry import resolve_backend
    from jaxrl_agentic.rollout.groups import EpisodeSpec

    recipe = args.config
    if recipe is None and args.model and args.env in (None, "frozen_lake") \
            and os.path.exists(DEFAULT_RECIPE):
        recipe = DEFAULT_RECIPE
    prefix, suffix, max_new = "", "", 64
    try:
        if recipe is None:
            name = args.env or "frozen_lake"
            try:  # each environment's own backend: a JAX env name stays on the JAX path
                python_env = resolve_backend(name) == "python"
            except ValueError as error:  # not the package's: a recipe's registers on import
                raise ValueError(f"{error}. An environment of your own (or a recipe's env "
                                 "tag) needs --config <recipe>: the recipe registers it, "
                                 "and --env then picks one of its env tags") from None
            if python_env:
                env = make_python_env(name)(EpisodeSpec(args.seed, 0, 0), 0)
            else:
                env, params = make(name)
        else:
            spec, prefix, suffix = recipe_env(recipe, args.env)
            python_env = resolve_backend(spec.env_type, spec.backend) == "python"
            if python_env:  # as the pipeline builds it
                env = make_python_env(spec.env_type, format_penalty=spec.format_penalty,
                                      **dict(spec.env_config))(EpisodeSpec(args.seed, 0, 0), 0)
            else:
                env, params = make(spec.env_type, format_penalty=spec.format_penalty,
                                   **dict(spec.env_config))
            max_new = spec.max_tokens_per_step
            print(f"env {spec.env_type} as in {recipe}", file=stdout)
    except ValueError as error:
        parser.error(str(error))
    prefix = prefix if args.reply_prefix is None else args.reply_prefix
    suffix = suffix if args.reply_suffix is None else args.reply_suffix
    max_new = max_new if args.max_new_tokens is None else args.max_new_tokens
    if args.model:
        from jaxrl_agentic.models import CheckpointError
        from jaxrl_agentic.runtime.checkpoint import CheckpointError as RunError

        try:
            policy = model_policy(args.model, stdout, max_new_tokens=max_new,
                                  temperature=args.temperature, greedy=args.greedy,
                                  seed=args.seed, reply_prefix=prefix, reply_suffix=suffix,
                                  tools=env.tool_schemas if python_env else None)
        except (CheckpointError, RunError) as error:
            parser.error(str(error))
    else:
        policy = stdin_policy(stdin, stdout)
    if python_env:
        play_python_episode(env, policy, args.seed, stdout, max_turns=args.max_turns)
    else:
        play_episode(env, params, policy, jax.random.key(args.seed), stdout,
                     max_turns=args.max_turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
