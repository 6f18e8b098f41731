"""Where a Sokoban policy fails: its greedy moves on held-out levels, judged by a solver.

    python scripts/analysis/sokoban_failures.py --checkpoint RUN/checkpoints/100 \
        [--config configs/sokoban.py] [--config.<key>=<value> ...] [--levels 256]

Runs the checkpoint's greedy eval (`val_env_manager`, with `--levels` groups), reads each
episode's first board from its prompt and replays the episode's actions on it with the
rules of `envs/sokoban.py`. A breadth-first solver (`tests/envs/solvers.py`, independent of
the JAX environment) gives d(s), the fewest moves that solve a position (None: unsolvable).
Each move from a solvable position s to s' is one of:

- `optimal`:  d(s') = d(s) − 1 (on a shortest solution);
- `detour`:   s' solvable, but not closer;
- `deadlock`: s' unsolvable (a box pushed into a corner or against a wall for good);
- `bump`:     s' = s (a wall, or a blocked box): under greedy decoding the board does not
              change, so the policy makes the same move again until the episode ends;
- `invalid`:  no action parsed from the reply.

Each failed episode is put down to the first of: `deadlock` (it made an unsolvable
position), `stuck` (its last two moves changed nothing), `circles` (it came back to a
position it had left, e.g. Left then Right), `too_long` (d at the start exceeds the turns
allowed: no policy solves it), `out_of_turns` (the rest). Prints one JSON line:
the eval metrics, the move counts, the failure causes, success by d at the start, and the
move counts by turn number.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.envs.solvers import parse_sokoban, sokoban_move, sokoban_path  # noqa: E402

ACTION_NAMES = ("Up", "Down", "Left", "Right")  # envs/sokoban.py's action ids
_CELL = "[#_OX√PS]"
_ROW = re.compile(rf"^{_CELL}(?: ?{_CELL})*$")


def last_board(text: str) -> str:
    """The last board in a prompt (the longest run of grid rows), separators removed."""
    runs, run = [], []
    for line in text.split("\n"):
        line = line.strip()
        if _ROW.match(line):
            run.append(line.replace(" ", ""))
            continue
        if run:
            runs.append(run)
        run = []
    if run:
        runs.append(run)
    if not runs:
        raise ValueError("no Sokoban board in the prompt")
    return "\n".join(runs[-1])


def move(position, action: str):
    """`Sokoban.transition`'s rule on a (walls, targets, boxes, player) tuple of sets."""
    walls, targets, boxes, player = position
    return (walls, targets, *sokoban_move(walls, boxes, player, action))


def _key(position):
    """What changes within an episode (the boxes and the player), hashable."""
    return frozenset(position[2]), position[3]


def distance(position) -> int | None:
    """Fewest moves that solve `position`, or None if it cannot be solved."""
    path = sokoban_path(*position)
    return None if path is None else len(path)


def judge_episode(board: str, actions: list[int], max_turns: int) -> dict:
    """Moves and outcome of one episode: `actions` are action ids, −1 for an invalid reply."""
    position = parse_sokoban(board)
    start = d = distance(position)
    moves, deadlocked = [], start is None
    seen = {_key(position)}
    revisited = False  # came back to a position it had left (a walk in a circle)
    for action in actions:
        if action < 0:
            moves.append("invalid")
            continue
        after = move(position, ACTION_NAMES[action])
        if after == position:
            kind = "bump"
        elif deadlocked:
            kind = "after_deadlock"
        else:
            d_after = distance(after)
            if d_after is None:
                kind, deadlocked = "deadlock", True
            else:
                kind = "optimal" if d_after == d - 1 else "detour"
            d = d_after
        moves.append(kind)
        revisited |= kind != "bump" and _key(after) in seen
        seen.add(_key(after))
        position = after
    solved = position[2] == position[1]
    if solved:
        cause = "solved"
    elif deadlocked:
        cause = "deadlock"
    elif len(moves) >= 2 and all(m in ("bump", "invalid") for m in moves[-2:]):
        cause = "stuck"
    elif revisited:
        cause = "circles"
    elif start is not None and start > max_turns:
        cause = "too_long"
    else:
        cause = "out_of_turns"
    return {"start_distance": start, "moves": moves, "cause": cause}


def distance_bucket(d: int | None) -> str:
    if d is None:
        return "unsolvable"
    for top in (2, 4, 6, 10):
        if d <= top:
            return f"<={top}"
    return ">10"


def summarize(episodes: list[dict]) -> dict:
    """Counts over judged episodes (`judge_episode`)."""
    moves = collections.Counter(m for e in episodes for m in e["moves"])
    causes = collections.Counter(e["cause"] for e in episodes)
    by_distance = collections.defaultdict(collections.Counter)
    by_turn = collections.defaultdict(collections.Counter)
    for e in episodes:
        by_distance[distance_bucket(e["start_distance"])][e["cause"] == "solved"] += 1
        for t, m in enumerate(e["moves"]):
            by_turn[t + 1][m] += 1
    total_moves = sum(moves.values())
    return {
        "episodes": len(episodes),
        "success": round(causes["solved"] / max(len(episodes), 1), 4),
        "moves": {k: round(v / max(total_moves, 1), 3) for k, v in sorted(moves.items())},
        "num_moves": total_moves,
        "causes": dict(sorted(causes.items())),
        "success_by_start_distance": {
            k: {"levels": sum(c.values()), "solved": c[True]}
            for k, c in sorted(by_distance.items())},
        "moves_by_turn": {t: dict(sorted(c.items())) for t, c in sorted(by_turn.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--config", default="configs/sokoban.py")
    parser.add_argument("--levels", type=int, default=256)
    args, overrides = parser.parse_known_args()

    from jaxrl_agentic.evaluate import evaluate_checkpoint

    pipeline, metrics, trajs = evaluate_checkpoint(
        ["failures", f"--config={args.config}", *overrides,
         f"--config.val_env_manager.num_env_groups={args.levels}"], args.checkpoint)
    decode = pipeline.formatter.tokenizer.decode
    max_turns = {tag: spec.max_turns for tag, spec in pipeline.config.envs.items()}
    episodes = []
    for traj in trajs:
        board = last_board(decode(traj.tokens[: traj.turns[0].context_len]))
        episodes.append(judge_episode(board, [t.action for t in traj.turns],
                                      max_turns[traj.tag]))
        if (episodes[-1]["cause"] == "solved") != bool(traj.turns[-1].success):
            raise SystemExit(f"episode {traj.traj_id}: the replay and the environment "
                             "disagree on success (the board was misread)")
    print(json.dumps({"checkpoint": args.checkpoint, "step": pipeline.step,
                      **{k: round(v, 4) for k, v in metrics.items()},
                      **summarize(episodes)}))


if __name__ == "__main__":
    main()
