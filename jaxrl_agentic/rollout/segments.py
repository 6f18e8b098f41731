"""Episodes that outgrow the context continue in segments: the stream side of a history policy.

Both schedules (`loop.play_turns`, `continuous.play_continuous`) hold one `Trajectory` per
episode, the episode's *current* segment, in `trajs[episode]`. `EpisodeSegments` keeps,
next to them, what a rewrite needs: each episode's history as chat messages (the first
prompt's, every reply, every environment answer) and its earlier segments.

When an episode's next prompt would exceed `max_input_length` (`append_prompt`), a policy
that rewrites (`rollout/history.py`) gives the messages to keep; the chat template renders
them whole (`ChatFormatter.history_prompt`), and when that prompt fits, the episode goes
on as a new sample:

    trajs[e] = Trajectory(segment = previous + 1, same (tag, group_id, member, seed),
                          tokens = the rendered prompt, turns = [])

with the sampler's row emptied and prefilled with the new stream (`reset_row`: continuous
batching's slots do the same when they take a new episode). The previous segment ends
where its last reply ended, neither terminated nor truncated (the episode goes on); its
turns, replies and logprobs are its own, so every generated token lies in exactly one
segment's loss mask, and the re-rendered replies in the new stream are context (mask 0).
When no policy applies, the rewritten prompt does not fit either, or the episode has
`MAX_SEGMENTS_PER_EPISODE` segments, the episode ends truncated by length, as under "full".

What stays the episode's across segments: its reward (each turn's, on that turn: the
episode's last reward on the last segment's last turn), its turn count for `max_turns` and
`max_steps_in_episode`, and its noise keys (the first segment's id and the episode's turn
index), so both schedules still draw the same tokens. Estimators and metrics see the
segments joined (`data.trajectory.episode_segments`, `joined_episode`).

Per-episode counts on its last segment's metrics (summed when segments are joined):
``history_rewrites`` and ``history_tokens_dropped`` (per rewrite, the whole next prompt's
length minus the rewritten prompt's); `pipeline/metrics.history_metrics` logs them.
"""

from __future__ import annotations

from jaxrl_agentic.data.trajectory import MAX_SEGMENTS_PER_EPISODE, Trajectory, segment_traj_id
from jaxrl_agentic.rollout.history import HistoryPolicy
from jaxrl_agentic.rollout.turns import append_prompt
from jaxrl_agentic.runtime import timing


class EpisodeSegments:
    """The segments and message histories of one batch of episodes (module doc). With the
    "full" policy it keeps no messages and only ends episodes, as `append_prompt` did."""

    def __init__(self, policy: HistoryPolicy, formatter, trajs: list[Trajectory], envs=None):
        self.policy, self.formatter, self.trajs = policy, formatter, trajs
        self.first_ids = [t.traj_id for t in trajs]
        self.turns_before = [0] * len(trajs)  # turns in an episode's earlier segments
        self.earlier: list[list[Trajectory]] = [[] for _ in trajs]
        self.rewrites = [0] * len(trajs)
        self.dropped = [0] * len(trajs)
        self.messages: dict[int, list[dict]] = {}
        self.tools: dict[int, list[dict] | None] = {}
        if policy.rewrites:
            system = ([{"role": "system", "content": formatter.system_prompt}]
                      if formatter.system_prompt else [])
            for episode, (messages, tools) in envs.first_messages().items():
                self.messages[episode] = system + list(messages)
                self.tools[episode] = list(tools) if tools else None

    # ---- what the schedules ask ----------------------------------------------------------------
    def turns_played(self, episode: int) -> int:
        """The episode's turns so far, over all its segments (its next turn's index)."""
        return self.turns_before[episode] + len(self.trajs[episode].turns)

    def row_seed(self, episode: int) -> int:
        """The id the episode's sampling noise is keyed by: its first segment's."""
        return self.first_ids[episode]

    def replied(self, episode: int, reply) -> None:
        """Records a reply (`turns.Reply`) as the assistant message the stream holds: the
        reply prefix and the generated text, without the parser's suffix."""
        if self.policy.rewrites:
            suffix = self.formatter.reply_suffix
            text = reply.reply[:len(reply.reply) - len(suffix)] if suffix else reply.reply
            self.messages[episode].append({"role": "assistant", "content": text})

    def answered(self, episode: int, outcome) -> None:
        """Records the environment's answer (`turns.EnvOutcome`) the next prompt holds."""
        if self.policy.rewrites:
            self.messages[episode].extend(outcome.next_messages())

    def append_prompt(self, episode: int, session, row: int, ids: list[int],
                      max_input_length: int) -> bool:
        """Appends the episode's next prompt to its stream and to session row `row`; when
        the whole prompt would not fit, continues the episode in a new segment from its
        rewritten history, or ends it truncated by length (module doc). → whether it goes
        on. The check runs on the real prompt, the exact one the sampler will see."""
        traj = self.trajs[episode]
        need = len(traj.tokens) + len(ids)
        if (need > max_input_length and self.policy.rewrites and traj.turns
                and traj.segment + 1 < MAX_SEGMENTS_PER_EPISODE):
            with timing.span("rollout/tokenize"):
                kept = self.policy(self.messages[episode])
                new_ids = self.formatter.history_prompt(kept, tools=self.tools[episode])
            if len(new_ids) <= max_input_length:
                self._next_segment(episode, new_ids)
                self.rewrites[episode] += 1
                self.dropped[episode] += need - len(new_ids)
                session.reset_row(row)
                session.extend([row], [new_ids])
                return True
        return append_prompt(traj, session, row, ids, max_input_length)  # or it ends

    def _next_segment(self, episode: int, ids: list[int]) -> None:
        old = self.trajs[episode]
        k = old.segment + 1
        self.earlier[episode].append(old)
        self.turns_before[episode] += len(old.turns)
        self.trajs[episode] = Trajectory(
            traj_id=segment_traj_id(self.first_ids[episode], k), group_id=old.group_id,
            tag=old.tag, seed=old.seed, tokens=list(ids), turns=[], member=old.member,
            segment=k, seat=old.seat)

    # ---- after the batch -----------------------------------------------------------------------
    def all_segments(self) -> list[Trajectory]:
        """Every segment, episode after episode, each episode's in segment order."""
        return [t for e, last in enumerate(self.trajs) for t in (*self.earlier[e], last)]

    def record_metrics(self) -> None:
        """Each episode's rewrite counts on its last segment (module doc); none under
        "full", whose runs log no history metrics."""
        if not self.policy.rewrites:
            return
        for e, traj in enumerate(self.trajs):
            traj.metrics["history_rewrites"] = float(self.rewrites[e])
            traj.metrics["history_tokens_dropped"] = float(self.dropped[e])
