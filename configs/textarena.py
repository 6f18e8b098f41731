"""TextArena's single-player games with the tiny default model on CPU: the game's own text is
the prompt, the reply its action, its rewards and end the episode's (`envs/textarena_env.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/textarena.py
    python -m jaxrl_agentic.train --config configs/textarena.py \
        --config.env_id=textarena:LightsOut-v0

`env_id` picks the game (`textarena:<EnvId>`; an unknown id, or one that needs the network
such as Wordle, is a one-line config error). The settings tuned for ThreeCardMonte are
marked as its own (`env_specific_settings`, jaxrl_agentic/env_specific.py), so another game
plays with its own constructor defaults (`game_kwargs={}`), replies of up to 8 tokens and a
warm-up on the example actions of its first message (`format_warmup.replies=()`); an
override of any of them still wins (GuessTheNumber's first message shows only `[5]`: give
it replies of its own, `--config.format_warmup.replies="('[3]','[10]','[17]')"`). The default
is TextArena's ThreeCardMonte with no shuffle (its constructor's `steps=0`): the game draws
the ball under one of three cups, and the reply names the cup, `[0]`, `[1]` or `[2]` (the
brackets are context and the model writes the digit, as the FrozenLake recipe's tags). The
tiny model learns to read where the ball is; with one shuffle, which it must follow, it did
not learn in a probe (docs/environments.md). FrozenLake 3×3 (`game_kwargs={"size": 3,
"num_holes": 2}`) costs ~27 s a step on one core: its boxed board is ~510 tokens, then ~240
a move. Held-out episodes play seeds training never sees.
"""

from jaxrl_agentic.config import env_manager, env_spec, env_specific_settings, tiny_grpo_recipe

GAME = "textarena:ThreeCardMonte-v0"


def get_config():
    c = tiny_grpo_recipe("textarena", "[", "]")
    c.max_steps = 800  # ~30 minutes on one core (~2 s a step)
    c.eval_before_training = True  # step 0: what the format warm-up alone reaches
    # The game's text is ~100 tokens: one 512-token row holds several episodes.
    c.max_input_length = 480
    c.sequence_length = 512
    c.micro_batch_max_tokens = 1024
    # The first message also shows `[k]` and `[X]`, which are not moves: warm up on the three.
    c.format_warmup.replies = ("[0]", "[1]", "[2]")
    # One generated token, the cup's digit; the rollout closes the reply (as the FrozenLake
    # recipe's action token). When the model also wrote the EOS, the policy began to read the
    # board, then its entropy jumped (0.8 → 3.1 nats a token, gradient norm 38), half its
    # replies turned invalid, and it settled on one cup for every board.
    c.custom_envs = {"game": env_spec(
        GAME, max_turns=2, max_tokens_per_step=1, format_penalty=0.1,
        env_backend="python", game_kwargs={"steps": 0})}
    # ThreeCardMonte's own: another `env_id` plays with the values given here instead.
    env_specific_settings(c, "game", {
        "custom_envs.game.env_config.game_kwargs": {},  # the game's own defaults
        "custom_envs.game.max_tokens_per_step": 8,  # a move such as `[A C]` or `[1 2 3 4]`
        "format_warmup.replies": (),  # the bracketed example actions of its first message
    })
    c.train_env_manager = env_manager(num_env_groups=8, group_size=4, tags=("game",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("game",))
    return c
