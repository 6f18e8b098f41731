"""An Elo table over a two-player run's saved checkpoints (and its start, and `random`).

    python scripts/analysis/selfplay_elo.py --run outputs/textarena_selfplay \
        [--games 24] [--tag game] [--plot elo.png]

Players: the run's policy when it started (`start`: its model after the format warm-up),
the policy at every checkpoint kept under `<run>/checkpoints/` (`step_<N>`; the self-play
recipe keeps all, `save_total_limit=0`), and `random` (a random listed move). Every pair
plays `--games` held-out games (validation seeds), each side in seat 0 on half of them
(`alternate_seats`), sampled at the run's `eval_temperature`, through the run's own seat
runner: one player is the runner's policy seat, the other a frozen seat whose params are
the other checkpoint's (`rollout/seats.py`), so both decode with the same sampler.

Ratings: the Bradley–Terry maximum-likelihood strengths of all results at once (a draw is
half a win for each side), by the minorisation–maximisation iteration of Hunter (2004),

    γ_i ← W_i / Σ_j n_ij / (γ_i + γ_j),     Elo_i = 400·log10(γ_i / γ_random),

so `random` is 0 (a player that never scores against anyone is put at −∞; one that always
scores, at +∞; neither is fitted). Prints one JSON line per player (`player`, `step`, `elo`,
`score`: its mean score over all its games, `games`), then one per pair (`a`, `b`, `wins`,
`draws`, `losses` of a), and with `--plot` draws Elo against the checkpoint's step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def bradley_terry_elo(results: dict[tuple[str, str], tuple[int, int, int]],
                      anchor: str, iterations: int = 2000) -> dict[str, float]:
    """Elo of each player from {(a, b): (a's wins, draws, losses)} (module doc), anchored
    at `anchor` = 0."""
    players = sorted({p for pair in results for p in pair})
    index = {p: i for i, p in enumerate(players)}
    n = np.zeros((len(players), len(players)))
    wins = np.zeros(len(players))
    for (a, b), (w, d, loss) in results.items():
        i, j = index[a], index[b]
        n[i, j] += w + d + loss
        n[j, i] += w + d + loss
        wins[i] += w + 0.5 * d
        wins[j] += loss + 0.5 * d
    games = n.sum(axis=1)
    fitted = (wins > 0) & (wins < games)
    gamma = np.ones(len(players))
    for _ in range(iterations):
        denom = (n / (gamma[:, None] + gamma[None, :]))
        denom = (denom * fitted[None, :]).sum(axis=1)
        new = np.where(fitted, wins / np.maximum(denom, 1e-300), gamma)
        new[fitted] /= np.exp(np.mean(np.log(new[fitted])))  # fix the scale
        if np.allclose(new, gamma, rtol=1e-10, atol=0):
            break
        gamma = new
    elo = {}
    base = gamma[index[anchor]] if fitted[index[anchor]] else 1.0
    for p, i in index.items():
        if not fitted[i]:
            elo[p] = math.inf if wins[i] >= games[i] > 0 else -math.inf
        else:
            elo[p] = float(400.0 * math.log10(gamma[i] / base))
    return elo


class _OnePlayer:
    """The `snapshots` of a seat runner whose frozen seat is one given player."""

    def __init__(self, version: int, params):
        self.version, self.params = version, params

    def params_for(self, kind: str):
        return self.version, self.params


def _checkpoint_players(run: str):
    """(flat config, pipeline, {player: (step, params)}): the start and each checkpoint."""
    from jaxrl_agentic.pipeline import Pipeline
    from jaxrl_agentic.rollout.snapshots import copy_params
    from jaxrl_agentic.run_config import as_run_config
    from jaxrl_agentic.run_loading import load_run_config, run_policy
    from jaxrl_agentic.runtime.checkpoint import Checkpointer

    c = load_run_config(run)
    pipeline = Pipeline(as_run_config(c), run_policy=run_policy, log=lambda *a, **k: None)

    def copy():
        return copy_params(pipeline.sampler_params())

    players = {"start": (0, copy())}
    checkpoints = Checkpointer(os.path.join(run, "checkpoints"))
    for step in sorted(checkpoints.manager.all_steps()):
        states, _ = checkpoints.restore(step, pipeline.train_states())
        pipeline.load_train_states(states)
        players[f"step_{step}"] = (int(step), copy())
    return c, pipeline, players


def play_pair(pipeline, tag: str, a, b, games: int, temperature: float, seed: int):
    """(wins, draws, losses) of player a (params, or "random") against b, over `games`
    held-out games with alternating seats; b may be "random", a may not."""
    from jaxrl_agentic.rollout.groups import EpisodeSpec

    opponent = "random" if b == "random" else "frozen:1"
    runner = pipeline.build_runner(tag, {"seats": ("policy", opponent), "alternate_seats": True})
    if b != "random":
        runner.snapshots = _OnePlayer(b[0], b[1])
    episodes = [EpisodeSpec(seed=2 * g + 1, group_id=g, member=0) for g in range(games)]
    trajs = runner.run(episodes, sample_seed=seed, params=a[1], greedy=temperature == 0,
                       temperature=temperature or None)
    wins = sum(t.metrics["game/win"] for t in trajs)
    losses = sum(t.metrics["game/loss"] for t in trajs)
    return int(wins), int(games - wins - losses), int(losses)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a two-player run's output directory")
    parser.add_argument("--games", type=int, default=24, help="games per pair (even)")
    parser.add_argument("--tag", default="game", help="the env tag whose game is played")
    parser.add_argument("--plot", default="", help="a PNG path for Elo against step")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.run, "checkpoints")):
        print(f"error: {args.run} has no checkpoints/ (a training run's output directory)",
              file=sys.stderr)
        return 2
    c, pipeline, players = _checkpoint_players(args.run)
    if args.tag not in c.custom_envs:
        print(f"error: --tag {args.tag!r} is not an env tag of the run "
              f"({', '.join(c.custom_envs.keys())})", file=sys.stderr)
        return 2
    names = list(players)
    results = {}
    for i, a in enumerate(names):
        for j, b in enumerate([*names[i + 1:], "random"]):
            results[a, b] = play_pair(pipeline, args.tag, players[a],
                                      "random" if b == "random" else players[b],
                                      args.games, c.eval_temperature, seed=1000 * i + j)
            print(f"{a} vs {b}: {results[a, b]} (wins, draws, losses)", file=sys.stderr)
    elo = bradley_terry_elo(results, anchor="random")
    for p in [*names, "random"]:
        points = games = 0.0
        for (a, b), (w, d, loss) in results.items():
            if p in (a, b):
                points += (w if p == a else loss) + 0.5 * d
                games += w + d + loss
        finite = math.isfinite(elo[p])
        print(json.dumps({"player": p, "step": players[p][0] if p in players else None,
                          "elo": round(elo[p], 1) if finite else None,
                          "unbounded": None if finite else "+" if elo[p] > 0 else "-",
                          "score": round(points / games, 3), "games": int(games)}))
    for (a, b), (w, d, loss) in results.items():
        print(json.dumps({"a": a, "b": b, "wins": w, "draws": d, "losses": loss}))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [players[p][0] for p in names if math.isfinite(elo[p])]
        values = [elo[p] for p in names if math.isfinite(elo[p])]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(steps, values, "o-", label="policy")
        ax.axhline(0.0, color="gray", ls="--", label="random")
        ax.set_xlabel("training step")
        ax.set_ylabel("Elo (random = 0)")
        ax.set_title(os.path.basename(os.path.normpath(args.run)))
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    pipeline.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
