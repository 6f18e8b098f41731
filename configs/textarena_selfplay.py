"""Self-play on TextArena's TicTacToe with the tiny default model on CPU, evaluated against a
random opponent (`envs/textarena_games.py`, `rollout/seats.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/textarena_selfplay.py

Training: both seats of every game are the policy (`seats=("policy", "policy")`, the
default of a two-player id), each seat in its own conversation, with TextArena's zero-sum
reward (+1 win, −1 loss, 0 draw) on its last turn; GRPO's baseline is per seat (a seat
against the same seat of its group's games: role-conditioned, as SPIRAL's RAE), so the
first mover's edge is not credited to its moves. Evaluation: 32 held-out games against
`random` (a random move among those the board lists), the policy in seat 0 on even groups
and in seat 1 on odd ones (`alternate_seats`): `eval/win_rate`, `eval/draw_rate`,
`eval/loss_rate`, `eval/seat0/win_rate`, `eval/seat1/win_rate`, `eval/invalid_moves`.

Why TicTacToe: a game is short (at most 5 moves a seat, ~1,500 tokens of a seat's
conversation with the tiny model's tokenizer), every observation lists the legal moves
(`Available Moves: '[0]', '[4]'`), so the random opponent is exact and a move is one digit,
and an untrained policy against random is measurable (a random mover wins ~0.58 of its games
as seat 0 and ~0.29 as seat 1). The reply is that digit: the brackets are context
(`reply_prefix="["`, `reply_suffix="]"`) and `max_tokens_per_step=1`, as the single-player
TextArena recipe does. The format warm-up plays seat 0 against random with the nine moves.
Kuhn Poker (`--config.env_id=textarena:KuhnPoker-v0`, with its moves
`--config.format_warmup.replies="('[check]','[bet]','[call]','[fold]')"` and
`--config.custom_envs.game.max_tokens_per_step=4`) has private cards; it is not tuned here.
"""

from jaxrl_agentic.config import env_manager, env_spec, tiny_grpo_recipe

GAME = "textarena:TicTacToe-v0"


def get_config():
    c = tiny_grpo_recipe("textarena_selfplay", "[", "]")
    c.max_steps = 60
    c.eval_steps = 10
    c.eval_before_training = True  # step 0: the warmed policy against random
    # Sampled evaluation: greedy, the warmed tiny policy writes one cell on every board and
    # loses each game on its second invalid move (step 0: win rate 0.00, 2 invalid moves).
    c.eval_temperature = 1.0
    # A seat's conversation: ~420 tokens of instructions and board, ~250 a move after.
    c.max_input_length = 2300
    c.sequence_length = 2304
    c.micro_batch_max_tokens = 4608
    c.format_warmup.replies = tuple(f"[{i}]" for i in range(9))
    # A seat makes at most 5 valid moves and as many forgiven invalid ones.
    c.custom_envs = {"game": env_spec(GAME, max_turns=10, max_tokens_per_step=1,
                                      env_backend="python")}
    # 8 games a step in 2 groups of 4: 16 seat trajectories, each seat's GRPO group of 4.
    c.train_env_manager = env_manager(num_env_groups=2, group_size=4, tags=("game",))
    c.mini_batch_size = 16
    c.val_env_manager = env_manager(
        num_env_groups=32, group_size=1, tags=("game",),
        env_config={"seats": ("policy", "random"), "alternate_seats": True})
    return c
