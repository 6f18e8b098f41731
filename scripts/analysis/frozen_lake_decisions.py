"""Where a FrozenLake policy goes wrong: its greedy moves on held-out maps, by situation.

    python scripts/analysis/frozen_lake_decisions.py --checkpoint RUN/checkpoints/150 \
        [--config configs/frozen_lake.py] [--config.<key>=<value> ...] [--maps 256]

Runs the checkpoint's greedy eval (`val_env_manager`, with `--maps` groups) and reads each
turn's short hint (`hint_style="short"`: "Goal: Up Right. Holes: left.") to sort the turns:

- `no_holes`: no neighbouring hole; right = a move towards the goal.
- `safe_goal_dir`: a neighbouring hole, but some move towards the goal is safe; right = one
  of those.
- `all_goal_dirs_holes`: every move towards the goal is a hole; right = any non-hole move.

Prints one JSON line: the eval metrics and, per situation, the number of turns and the
fractions right / into a hole / other (e.g. away from the goal, or into the edge);
`safe_goal_dir_by_turn`: the `safe_goal_dir` turns and their hole fraction by turn number
(does the policy read only the first hint, or the current one among earlier ones?). Under
`moves_next_to_holes`, for each goal hint ("Down Left"), the moves chosen on the turns with
a neighbouring hole: a policy that reads the holes spreads them, one that does not picks the
same move whatever the holes (the failure this script was written to find).
"""

from __future__ import annotations

import argparse
import collections
import json
import re

ACTIONS = ("Left", "Down", "Right", "Up")


def read_hint(hint: str) -> tuple[list[str], list[str]]:
    """(directions towards the goal as the hint orders them, directions with a hole)."""
    goal_part, _, holes_part = hint.partition("Holes:")
    goal = goal_part.removeprefix("Goal:").strip(" .").split()
    return goal, [a for a in ACTIONS if a.lower() in holes_part]


def classify(goal: list[str], holes: list[str], action: str) -> tuple[str, str]:
    """(situation, outcome) of one move, from the hint (`read_hint`) it was chosen on."""
    safe_goal = [a for a in goal if a not in holes]
    if not holes:
        situation = "no_holes"
    else:
        situation = "safe_goal_dir" if safe_goal else "all_goal_dirs_holes"
    right = action in safe_goal if safe_goal else action not in holes
    return situation, "right" if right else ("hole" if action in holes else "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--config", default="configs/frozen_lake.py")
    parser.add_argument("--maps", type=int, default=256)
    args, overrides = parser.parse_known_args()

    from jaxrl_agentic.evaluate import evaluate_checkpoint

    pipeline, metrics, trajs = evaluate_checkpoint(
        ["decisions", f"--config={args.config}", *overrides,
         f"--config.val_env_manager.num_env_groups={args.maps}"], args.checkpoint)
    decode = pipeline.formatter.tokenizer.decode
    counts = collections.defaultdict(collections.Counter)
    moves_by_goal = collections.defaultdict(collections.Counter)
    safe_goal_by_turn = collections.defaultdict(collections.Counter)
    for traj in trajs:
        for index, turn in enumerate(traj.turns):
            hints = re.findall(r"Goal:[^\n<]*", decode(traj.tokens[: turn.context_len]))
            if not hints:
                raise SystemExit("no short hint in the prompt: needs hints=True, "
                                 "hint_style='short'")
            action = ACTIONS[turn.action] if turn.action >= 0 else "invalid"
            goal, holes = read_hint(hints[-1])
            situation, outcome = classify(goal, holes, action)
            counts[situation][outcome] += 1
            if situation == "safe_goal_dir":
                safe_goal_by_turn[index + 1][outcome] += 1
            if holes:
                moves_by_goal[" ".join(goal)][action] += 1
    by_situation = {
        name: {"turns": sum(c.values()),
               **{k: round(v / sum(c.values()), 3) for k, v in sorted(c.items())}}
        for name, c in sorted(counts.items())
    }
    print(json.dumps({"step": pipeline.step, "maps": args.maps,
                      **{k: round(v, 4) for k, v in metrics.items()},
                      "decisions": by_situation,
                      "safe_goal_dir_by_turn": {
                          turn: {"turns": sum(c.values()),
                                 "hole": round(c["hole"] / sum(c.values()), 3)}
                          for turn, c in sorted(safe_goal_by_turn.items())},
                      "moves_next_to_holes": {goal: dict(sorted(moves.items()))
                                              for goal, moves in sorted(moves_by_goal.items())}}))


if __name__ == "__main__":
    main()
