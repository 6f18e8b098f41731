"""Reading the action out of a model reply such as `<think>…</think><answer>Left</answer>`.

One parser for every environment. Rules:
  * an answer is `<answer>CONTENT</answer>` with CONTENT free of another `<answer>` (so in
    nested or unclosed tags the innermost closed pair counts); tags match in any ASCII case;
  * the *last* answer in the reply wins, even when its content names no action (a model
    that corrects itself means the correction);
  * CONTENT, stripped of surrounding whitespace, must equal an action name ignoring case;
  * anything else gives None. The parser never raises.
"""

import re
from typing import Any

# The answer tag of every environment (tool environments read their final answer with it).
# ASCII: under Unicode case folding the Kelvin sign would pass for a "k", and so on.
ANSWER_TAG = re.compile(
    r"<answer>((?:(?!<answer>).)*?)</answer>", re.IGNORECASE | re.ASCII | re.DOTALL
)
# Action names are short; longer contents cannot match and need no normalising.
_MAX_CONTENT_CHARS = 256


def parse_action(reply: Any, action_names: tuple[str, ...]) -> int | None:
    """Index into `action_names` of the last answer in `reply`, or None (see module doc)."""
    if isinstance(reply, bytes | bytearray):
        reply = bytes(reply).decode("utf-8", errors="replace")
    if not isinstance(reply, str):
        return None
    answers = ANSWER_TAG.findall(reply)
    if not answers or len(answers[-1]) > _MAX_CONTENT_CHARS:
        return None
    content = answers[-1].strip().casefold()
    for index, name in enumerate(action_names):
        if content == name.casefold():
            return index
    return None
