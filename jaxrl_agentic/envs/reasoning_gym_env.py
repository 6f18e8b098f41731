"""`reasoning_gym:<dataset>`: reasoning-gym's procedural datasets as Python environments.

One dataset item is one episode. The item of episode seed `s` is item 0 of the dataset that
reasoning-gym builds with seed `s` (`config` = the dataset's config dataclass):

    item(s) = reasoning_gym.create_dataset(dataset, seed=s, size=1, **dataset_config)[0]

so it depends on the episode seed and the dataset config only (not on the run seed), and the
held-out episodes, whose seeds training never uses (`rollout/groups.py`), play items of their
own seeds. (A small config, e.g. two one-digit terms, has few distinct questions: held-out
seeds then repeat questions seen in training.)

The first user message is the item's question and one line asking for
`<answer>ANSWER</answer>`. A reply with an answer (`tools.parse_answer`: the last closed
tag) ends the episode; its reward is the dataset's own `score_answer(answer, item)` (1.0 for
a right answer; reasoning-gym's default scorer gives an answer that contains the right one
len(right) / len(answer), e.g. 0.2 for "146 legs in all" against "146"), and `success` is a
full score (>= 1.0). A reply without an answer costs
`format_penalty` and gets a message saying how to answer; the episode goes on, up to
`max_steps_in_episode` replies (default 2).

With `tools=("calculate",)` (names of registered tools, `tools.register_tool`) the episode
is a `ToolEnv`: tool calls, their errors and penalties work exactly as in the `calculator`
environment, the answer ends the episode with the dataset's score as reward (less any tool
error penalty), and `max_steps_in_episode` defaults to 4.

    factory = make_python_env("reasoning_gym:basic_arithmetic", format_penalty=0.1,
                              dataset_config={"max_terms": 2, "max_digits": 1})
    env = factory(EpisodeSpec(seed=1, group_id=0, member=0), run_seed=0)
    env.reset(1)                    # "Calculate 5 - 3.\n\nGive your final answer as <answer>…"
    env.step("<answer>2</answer>")  # PyStep(reward=1.0, success=True, terminated=True, ...)

Config (top-level keys; anything else is a ValueError): `format_penalty`, `dataset_config`
(the dataset's own parameters, e.g. `min_terms`, `max_digits`; `seed` and `size` are the
environment's), `tools`, `max_steps_in_episode`, and for tool episodes `tool_error_penalty`,
`max_calls_per_turn`, `call_timeout_s`, `max_tool_error_penalty`, `call_style` (`ToolEnv`;
they change nothing without tools). reasoning-gym is imported by the builder, not by this
module: `pip install -e '.[envs]'`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_agentic.envs.base import INVALID_ACTION
from jaxrl_agentic.envs.mcp_tools import server_tools
from jaxrl_agentic.envs.python_env import EpisodeKey, PyStep, PythonTextEnv, text_state_hash
from jaxrl_agentic.envs.registry import register_prefix
from jaxrl_agentic.envs.tools import ToolEnv, format_tool_call, parse_answer, tool_responses

PREFIX = "reasoning_gym:"
FULL_SCORE = 1.0  # reasoning-gym scores lie in [0, 1]; 1.0 is a right answer
INSTRUCTION = "Give your final answer as <answer>ANSWER</answer>."
NO_ANSWER = ("Your reply had no answer. Give your final answer inside answer tags, "
             "as <answer>ANSWER</answer>.")
DEFAULT_MAX_STEPS = 2
DEFAULT_MAX_STEPS_WITH_TOOLS = 4
# Config keys the environment reads; the `ToolEnv` ones matter only with tools.
OPTIONS = ("format_penalty", "dataset_config", "tools", "max_steps_in_episode")
TOOL_OPTIONS = ("tool_error_penalty", "max_calls_per_turn", "call_timeout_s",
                "max_tool_error_penalty", "call_style", "mcp_servers")
# The environment sets these dataset config fields itself.
RESERVED_DATASET_FIELDS = ("seed", "size")


def _registry(dataset: str) -> dict:
    """reasoning-gym's {name: (dataset class, config class)}, imported on first use."""
    try:
        import reasoning_gym  # noqa: F401  (registers every dataset)
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ImportError(f"{PREFIX}{dataset} needs the reasoning-gym package: "
                          "pip install -e '.[envs]'") from exc
    return DATASETS


class DatasetItems:
    """The items of one dataset and config, by episode seed (module doc), each with the
    dataset instance that made it (its `score_answer` scores the replies).

    Members of a group share a seed: the last `cache_size` seeds' datasets are kept, so a
    group builds its dataset once (some datasets load data files when built). Thread-safe;
    two threads that miss the same seed at once both build it, with equal results."""

    def __init__(self, dataset: str, dataset_config: Mapping[str, Any], cache_size: int = 64):
        self.dataset, self.dataset_config = dataset, dict(dataset_config)
        self.cache_size = int(cache_size)
        self._cache: collections.OrderedDict[int, tuple[Any, dict]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, seed: int) -> tuple[Any, dict[str, Any]]:
        """(dataset, item) of episode seed `seed`; the item is the caller's own copy."""
        seed = int(seed)
        with self._lock:
            hit = self._cache.get(seed)
            if hit is not None:
                self._cache.move_to_end(seed)
        if hit is None:
            import reasoning_gym

            data = reasoning_gym.create_dataset(self.dataset, seed=seed, size=1,
                                                **self.dataset_config)
            hit = (data, data[0])
            with self._lock:
                self._cache[seed] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        data, item = hit
        return data, copy.deepcopy(item)


def score(data: Any, answer: str, item: Mapping[str, Any]) -> float:
    """The dataset's `score_answer(answer, item)` as a float; 0.0 when the scorer raises on
    the answer or returns no finite number (a reply must never crash the episode)."""
    try:
        value = float(data.score_answer(answer, item))
    except Exception:  # the scorer choked on the model's text: a wrong answer
        return 0.0
    return value if math.isfinite(value) else 0.0


def another_items_answer_policy(dataset: str, dataset_config: Mapping[str, Any] | None = None):
    """The format warm-up's text policy (`warmup.py`): `make(rng)` → `reply(text)`, which
    answers with the stored answer of another item of the same dataset (a random seed
    above the episodes' range), in `<answer>` tags. It teaches the shape and range of the
    dataset's answers, not the answer to the question asked."""
    items = DatasetItems(dataset, dict(dataset_config or {}))

    def make(rng, **_unused):
        def reply(text: str) -> str:
            del text
            _, item = items.get(2**40 + rng.randrange(2**20))
            return f"<answer>{item['answer']}</answer>"

        return reply

    return make


# A run of numbers and + − × ÷ with at least one operator between two numbers.
_EXPRESSION = re.compile(r"[\d(][\d\s.()+\-*/]*[\d)]")
_OPERATION = re.compile(r"[\d)]\s*[-+*/]\s*[\d(]")


def question_expression(question: str) -> str | None:
    """The longest arithmetic expression written in a question ("Calculate 13 - 92." →
    "13 - 92"), or None when it has none."""
    found = [m.group().strip() for m in _EXPRESSION.finditer(question)]
    found = [e for e in found if _OPERATION.search(e)]
    return max(found, key=len) if found else None


def call_or_guess_policy(dataset: str, dataset_config: Mapping[str, Any] | None = None, *,
                         call_style: str = "qwen", call_share: float = 1 / 3):
    """The format warm-up's text policy (`warmup.py`) of a dataset with the calculator as
    its tool: `make(rng)` → `reply(text)`. The first reply of an episode is, a `call_share`
    of the time, a call of `calculate` on the expression the question writes
    (`question_expression`), otherwise another item's answer
    (`another_items_answer_policy`); after a tool result, the answer is that result.

    It shows both ways to reply and how to call; greedy decoding then answers without
    calling (the likelier first token), so what the warmed model scores is the guesses'.
    Which way pays is for RL to learn. A question without an expression is always guessed.
    """
    guesses = another_items_answer_policy(dataset, dataset_config)

    def make(rng, **_unused):
        guess = guesses(rng)

        def reply(text: str) -> str:
            results = tool_responses(text)
            if results:
                return f"<answer>{results[-1].strip()}</answer>"
            expression = question_expression(tool_question(text) or "")
            if expression and rng.random() < call_share:
                return format_tool_call("calculate", {"expression": expression}, call_style)
            return guess(text)

        return reply

    return make


def tool_question(text: str) -> str | None:
    """The question of a tool episode's first message, found in the rendered chat around it:
    the paragraph just above the instructions, after the last line of chat markup (``<|…``);
    None when the text has no instructions. The tool warm-up's policy calls on its expression
    (`call_or_guess_policy`)."""
    head, found, _ = text.partition("\n\n" + ReasoningGymToolEnv.instructions)
    if not found:
        return None
    lines = head.rsplit("\n\n", 1)[-1].split("\n")
    markup = [i for i, line in enumerate(lines) if "<|" in line]
    return "\n".join(lines[markup[-1] + 1:] if markup else lines)


def _first_message(question: str, instruction: str) -> str:
    return f"{question.rstrip()}\n\n{instruction}"


class ReasoningGymEnv(PythonTextEnv):
    """One dataset item per episode, answered in `<answer>` tags (module doc)."""

    def __init__(self, items: DatasetItems, *, format_penalty: float = 0.1,
                 max_steps_in_episode: int = DEFAULT_MAX_STEPS):
        self.items = items
        self.name = PREFIX + items.dataset
        self.format_penalty = float(format_penalty)
        self.max_steps_in_episode = int(max_steps_in_episode)
        self.question: str | None = None
        self.answer: Any = None
        self.item: dict[str, Any] | None = None
        self._data: Any = None
        self._turn = 0

    def reset(self, seed: int) -> str:
        self._data, self.item = self.items.get(seed)
        self.question, self.answer = str(self.item["question"]), self.item.get("answer")
        self._turn = 0
        return _first_message(self.question, INSTRUCTION)

    def step(self, reply: str) -> PyStep:
        if self.item is None:
            raise RuntimeError("step() before reset()")
        self._turn += 1
        given = parse_answer(reply)
        if given is None:
            return PyStep(observation=NO_ANSWER, reward=-self.format_penalty, terminated=False,
                          action_is_valid=False, action_is_effective=False, success=False,
                          action=INVALID_ACTION)
        value = score(self._data, given, self.item)
        return PyStep(observation="", reward=value, terminated=True, action_is_valid=True,
                      action_is_effective=True, success=value >= FULL_SCORE, action=0)

    def state_hash(self) -> bytes:
        if self.question is None:
            raise RuntimeError("state_hash() before reset()")
        return text_state_hash(f"{self.question}\x00{self._turn}")


class ReasoningGymToolEnv(ToolEnv):
    """One dataset item per episode with tools (`ToolEnv`); the reward of the answer is the
    dataset's score, as without tools (less the tool error penalties)."""

    instructions = ("You may call the tools; their results come back to you. "
                    + INSTRUCTION)

    def __init__(self, items: DatasetItems, *, tools: Sequence[str],
                 mcp_servers: Sequence[str] = (), **tool_env_options: Any):
        servers = server_tools(mcp_servers, tool_env_options.get("call_timeout_s", 1.0))
        super().__init__([], extra_tools=tuple(tools) + servers, **tool_env_options)
        self.items = items
        self.name = PREFIX + items.dataset
        self.item: dict[str, Any] | None = None
        self._data: Any = None
        self._score = 0.0

    def new_task(self, seed: int) -> tuple[str, Any]:
        self._data, self.item = self.items.get(seed)
        return str(self.item["question"]), self.item.get("answer")

    def reset(self, seed: int) -> str:
        super().reset(seed)
        return _first_message(self.question, self.instructions)

    def is_correct(self, given: str, answer: Any) -> bool:
        del answer  # the dataset scores against the whole item
        self._score = score(self._data, given, self.item)
        return self._score >= FULL_SCORE

    def step(self, reply: str) -> PyStep:
        self._score = 0.0
        step = super().step(reply)
        if step.action == 0 and not step.success and self._score > 0.0:
            # ToolEnv pays `correct_reward` or nothing: add the dataset's partial credit
            step = dataclasses.replace(step, reward=step.reward + self._score)
        return step


def _tool_names(tools: Any) -> tuple[str, ...]:
    if tools is None:
        return ()
    if isinstance(tools, str):
        return (tools,)
    if not isinstance(tools, Sequence) or not all(isinstance(t, str) for t in tools):
        raise ValueError(f"tools must be a sequence of registered tool names, got {tools!r}")
    return tuple(tools)


def _dataset_config(name: str, config_cls: type, dataset_config: Any) -> dict[str, Any]:
    try:
        dataset_config = dict(dataset_config or {})
    except (TypeError, ValueError):
        raise ValueError(f"{name}: dataset_config must be a mapping of the dataset's "
                         f"parameters, got {dataset_config!r}") from None
    fields = [f.name for f in dataclasses.fields(config_cls)
              if f.name not in RESERVED_DATASET_FIELDS]
    reserved = sorted(set(dataset_config) & set(RESERVED_DATASET_FIELDS))
    if reserved:
        raise ValueError(f"{name}: dataset_config may not set {', '.join(reserved)}: the "
                         "episode seed chooses the item")
    unknown = sorted(set(dataset_config) - set(fields))
    if unknown:
        raise ValueError(f"{name}: unknown dataset_config key(s) {', '.join(unknown)}; "
                         f"the dataset's parameters: {', '.join(fields)}")
    return dataset_config


def reasoning_gym_builder(dataset: str, *, format_penalty: float = 0.1,
                          dataset_config: Mapping[str, Any] | None = None,
                          tools: Sequence[str] | None = (),
                          max_steps_in_episode: int | None = None, **options: Any):
    """`make_python_env("reasoning_gym:<dataset>", **config)`: the episode factory
    `(spec, run_seed) -> env` (module doc). Bad names and config fail here, at config
    time: the item of seed 0 is built once to check the dataset config."""
    name = PREFIX + dataset
    datasets = _registry(dataset)
    if dataset not in datasets:
        close = difflib.get_close_matches(dataset, list(datasets), n=5, cutoff=0.6)
        hint = (f"close matches: {', '.join(PREFIX + c for c in close)}" if close else
                f"reasoning-gym's datasets: {', '.join(sorted(datasets))}")
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r} ({name}); {hint}")
    config_cls = datasets[dataset][1]
    unknown = sorted(set(options) - set(TOOL_OPTIONS))
    if unknown:
        fields = {f.name for f in dataclasses.fields(config_cls)}
        hint = (f"; the dataset's own parameters ({', '.join(sorted(set(unknown) & fields))})"
                " go in dataset_config={...}" if set(unknown) & fields else "")
        raise ValueError(f"{name}: unknown config key(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(OPTIONS + TOOL_OPTIONS)}{hint}")
    tool_names = _tool_names(tools)
    if max_steps_in_episode is None:
        max_steps_in_episode = (DEFAULT_MAX_STEPS_WITH_TOOLS if tool_names else
                                DEFAULT_MAX_STEPS)
    if isinstance(max_steps_in_episode, bool) or not isinstance(max_steps_in_episode, int) \
            or max_steps_in_episode < 1:
        raise ValueError(f"{name}: max_steps_in_episode must be an int >= 1, "
                         f"got {max_steps_in_episode!r}")
    if not float(format_penalty) >= 0.0:
        raise ValueError(f"{name}: format_penalty must be >= 0, got {format_penalty!r}")
    items = DatasetItems(dataset, _dataset_config(name, config_cls, dataset_config))
    try:
        items.get(0)
    except (TypeError, ValueError, AssertionError) as exc:  # the config's validate() asserts
        raise ValueError(f"{name}: bad dataset_config {items.dataset_config!r}: "
                         f"{type(exc).__name__}: {exc}") from None

    def make_env() -> PythonTextEnv:
        if tool_names:
            return ReasoningGymToolEnv(items, tools=tool_names, format_penalty=format_penalty,
                                       max_steps_in_episode=max_steps_in_episode, **options)
        return ReasoningGymEnv(items, format_penalty=format_penalty,
                               max_steps_in_episode=max_steps_in_episode)

    try:  # bad tool names and ToolEnv options fail here, not in a worker thread
        make_env()
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None

    def factory(spec: EpisodeKey, run_seed: int) -> PythonTextEnv:
        del spec, run_seed  # the item is the episode seed's (reset); members share it
        return make_env()

    return factory


register_prefix(PREFIX, reasoning_gym_builder)
