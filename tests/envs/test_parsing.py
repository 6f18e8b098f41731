import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agentic.envs import parse_action

NAMES = ("Left", "Down", "Right", "Up")


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("<think>the goal is below</think><answer>Down</answer>", 1),
        ("<answer>Left</answer>", 0),
        ("<ANSWER>  rIGHT \n</Answer>", 2),
        ("<answer>\nup\n</answer><|im_end|>", 3),
        ("<answer>Left</answer> no wait <answer>Right</answer>", 2),  # the last one wins
        ("<answer>Left</answer> no wait <answer>Jump</answer>", None),  # ...even if invalid
        ("<answer>Left</answer><answer>Right", 0),  # an unclosed tag is not an answer
        ("<answer><answer>Up</answer>", 3),  # innermost closed pair
        ("<answer>Up</answer></answer>", 3),
        ("<answer>Left", None),
        ("Left", None),  # no tags
        ("", None),
        ("<answer></answer>", None),
        ("<answer>Le ft</answer>", None),
        ("<answer>Left.</answer>", None),
        ("<answer>Left Right</answer>", None),
        ("<answer>\ufffd\ufffdLeft</answer>", None),
        ("<think><answer>Up</answer></think>", 3),
        ("<answer>Down</answer><think>maybe <answer>Left</think>", 1),
    ],
)
def test_hand_made_replies(reply, expected):
    assert parse_action(reply, NAMES) == expected


def test_non_text_and_huge_inputs_do_not_raise():
    assert parse_action(None, NAMES) is None
    assert parse_action(b"<answer>Up</answer>\xff\xfe", NAMES) == 3
    huge = "<answer>" * 50_000 + "x" * 1_000_000 + "<answer>Right</answer>"
    assert parse_action(huge, NAMES) == 2
    assert parse_action("<answer>" + "Left" * 100_000 + "</answer>", NAMES) is None


FRAGMENTS = st.sampled_from(
    ["<answer>", "</answer>", "<ANSWER>", "</Answer>", "<think>", "</think>", "<|im_end|>",
     "Left", "up", "DOWN", " ", "\n", "\ufffd", "<", ">", "/", "answer"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=20)), max_size=30))
def test_parse_never_raises_and_returns_a_valid_id_or_none(pieces):
    result = parse_action("".join(pieces), NAMES)
    assert result is None or (isinstance(result, int) and 0 <= result < len(NAMES))


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(max_size=40),
    index=st.integers(0, len(NAMES) - 1),
    upper=st.lists(st.booleans(), min_size=5, max_size=5),
    left=st.sampled_from(["", " ", "\n", "\t "]),
    right=st.sampled_from(["", " ", "\n"]),
    suffix=st.text(max_size=40).filter(lambda s: "answer>" not in s.lower()),
)
def test_a_final_answer_is_found_after_any_prefix(prefix, index, upper, left, right, suffix):
    name = "".join(c.upper() if u else c.lower() for c, u in zip(NAMES[index], upper, strict=False))
    reply = f"{prefix}<answer>{left}{name}{right}</answer>{suffix}"
    assert parse_action(reply, NAMES) == index
