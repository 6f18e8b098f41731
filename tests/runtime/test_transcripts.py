"""Episode transcripts: cut from the trajectory's own token stream, so they show exactly the
contexts and replies the learner trains on, with the episode's outcome and tool counts."""

import os

import transformers

from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.runtime.transcripts import eval_transcripts, write_transcripts
from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies
from tests.test_pipeline_tools import garbled_then_oracle


def test_a_tool_episode_reads_turn_by_turn(tiny_model_dir, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    formatter = ChatFormatter(tokenizer)
    sampler = ScriptedSampler(text_policy_replies(formatter, garbled_then_oracle, seed=0),
                              max_total_len=4096)
    runner = PythonRolloutRunner(make_python_env("calculator"), sampler, formatter,
                                 tag="calculator", max_turns=4, max_input_length=3000,
                                 generation=GenerationConfig(max_tokens_per_step=512))
    trajs = runner.run([EpisodeSpec(seed=s, group_id=i, member=0)
                        for i, s in enumerate((3, 4))], sample_seed=0)
    text = eval_transcripts(tokenizer, trajs, limit=5)
    first, second = text.split("\n\n=== ")
    assert first.startswith(
        "=== episode 1 of 2: env calculator, seed 3, 3 turns, return 0.9, terminated, "
        "success 1, tool calls 2, tool errors 1, tool timeouts 0 ===")
    assert second.startswith("episode 2 of 2: env calculator, seed 4")
    t = trajs[0]
    # Nothing lost or reordered: the pieces between the labels are the stream, decoded.
    lines = first.split("\n")[1:]
    labels = [i for i, line in enumerate(lines)
              if line == "[context]" or line.startswith("[reply ")]
    ends = labels[1:] + [len(lines)]
    pieces = ["\n".join(lines[a + 1:b]) for a, b in zip(labels, ends, strict=True)]
    end = t.turns[-1].context_len + len(t.turns[-1].generated)
    assert "".join(pieces) == tokenizer.decode(t.tokens[:end], skip_special_tokens=False)
    assert [lines[i] for i in labels if lines[i] != "[context]"] == [
        "[reply 1] (reward -0.1, invalid)", "[reply 2] (reward 0)", "[reply 3] (reward 1)"]
    for turn in t.turns:  # each reply as the environment read it
        assert turn.reply in first
    assert first.count("<tool_response>") == 2  # the error message, then the result
    assert eval_transcripts(tokenizer, trajs, limit=1).count("=== episode") == 1
    path = write_transcripts(str(tmp_path / "transcripts"), 7, text)
    assert path.endswith(os.path.join("transcripts", "eval_step_7.txt"))
    with open(path) as f:
        assert f.read() == text + "\n"
    assert os.listdir(tmp_path / "transcripts") == ["eval_step_7.txt"]
