"""Readable transcripts of episodes: what the model was shown and what it said, turn by turn.

Training writes the first `eval_transcripts` held-out episodes of every eval to TensorBoard
text (`episodes/eval_transcripts`) and to `<output_dir>/transcripts/eval_step_<N>.txt`, so
what the agent does can be read after the run: every context piece with its chat markup
(system turn, tools block, user turns, `<tool_response>` blocks), every reply exactly as
generated, the turn's reward, and the episode's outcome and tool counts.

The pieces are cut from the trajectory's own token stream at the turn boundaries (the
tokens the learner trains on), not re-rendered from messages, so a transcript cannot
disagree with the training data.
"""

from __future__ import annotations

import os

from jaxrl_agentic.data.trajectory import episode_segments, joined_episode

# Per-episode metrics shown in a transcript's header, when the episode has them.
_HEADER_METRICS = (("success", "success"), ("tool/calls", "tool calls"),
                   ("tool/errors", "tool errors"), ("tool/timeouts", "tool timeouts"))


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def episode_transcript(tokenizer, traj, *, title: str = "episode") -> str:
    """One episode as text: a header line, then per turn the context appended since the
    previous reply (``[context]``) and the reply (``[reply t]``, with its reward and why
    generation stopped when it was not the end-of-turn token). `traj` may be an episode's
    segments (a list, in order: a rewritten history, `Trajectory.segment`): each later one
    is marked and starts with its whole rewritten context."""
    segments = list(traj) if isinstance(traj, list | tuple) else [traj]
    whole = joined_episode(segments)
    counts = [f"{label} {whole.metrics[key]:g}" for key, label in _HEADER_METRICS
              if key in whole.metrics]
    ending = ("terminated" if whole.terminated
              else "cut by the context length" if whole.truncated_by_length
              else "turn limit" if whole.truncated else "not ended")
    parts = f", {len(segments)} samples (history rewritten)" if len(segments) > 1 else ""
    lines = [f"=== {title}: env {whole.tag}, seed {whole.seed}, {len(whole.turns)} turns, "
             f"return {whole.score:g}, {ending}{parts}"
             + "".join(f", {c}" for c in counts) + " ==="]
    t = 0
    for seg in segments:
        if getattr(seg, "segment", 0) > 0:
            lines.append(f"[sample {seg.segment + 1}: the history was rewritten]")
        pos = 0
        for turn in seg.turns:
            t += 1
            lines += ["[context]", _decode(tokenizer, seg.tokens[pos:turn.context_len])]
            notes = [f"reward {turn.reward:g}"]
            if turn.stop_reason != "eos":
                notes.append(f"stopped by {turn.stop_reason}")
            if not turn.action_is_valid:
                notes.append("invalid")
            lines += [f"[reply {t}] ({', '.join(notes)})", _decode(tokenizer, turn.generated)]
            pos = turn.context_len + len(turn.generated)
    return "\n".join(lines)


def eval_transcripts(tokenizer, trajs, limit: int) -> str:
    """The first `limit` episodes that have turns, as one text ("" when there are none); an
    episode in segments is one episode."""
    episodes = [[trajs[i] for i in e] for e in episode_segments(trajs)]
    shown = [e for e in episodes if any(t.turns for t in e)][:limit]
    return "\n\n".join(episode_transcript(tokenizer, e, title=f"episode {i + 1} of "
                                          f"{len(shown)}") for i, e in enumerate(shown))


def write_transcripts(directory: str, step: int, text: str) -> str:
    """Writes `text` to `<directory>/eval_step_<step>.txt` (whole or not at all: a
    temporary file renamed into place) and returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"eval_step_{step}.txt")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    return path
