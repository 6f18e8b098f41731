"""`lookup`: two-hop questions over a generated key-value world, tools `search` and `get`.

Each seed generates a small world of people and cities with opaque keys:

    person/3   name: Alia Moren | born: 1962 | lives in: city/1
    city/1     name: Velora | country: Drenia | founded: 1204 | mayor: person/7

(one `field: value` per line in a record) and one question whose answer needs two hops
through it, e.g. "In which year was the mayor of Velora born?" (city → its mayor → the
mayor's birth year). Tools:

- `search(query)`: the keys and names of the records whose text contains every word of
  the query (case-insensitive), at most 5, as `key: name` lines, or `No results.`;
- `get(key)`: the record of `key`; an unknown key is an error (counted and penalised).

`LookupOracle` answers every question from the messages alone: search the name in the
question, get its record, follow the link, get that record, answer the field.
"""

from __future__ import annotations

import random
import re
from typing import Any

from jaxrl_agentic.envs.mcp_tools import server_tools
from jaxrl_agentic.envs.tools import (
    Tool,
    ToolEnv,
    format_tool_call,
    tool_env_factory,
    tool_responses,
)

MAX_SEARCH_RESULTS = 5
_SYLLABLES = ("al", "ba", "cor", "da", "el", "fen", "gar", "hal", "ir", "jo", "ka", "lin",
              "mor", "na", "ol", "pe", "quin", "ra", "sel", "tor", "ul", "ve", "wen", "zan")

# (question with {name}, kind of the named record, link field, field of the linked record)
QUESTIONS = (
    ("In which year was the mayor of {name} born?", "city", "mayor", "born"),
    ("In which country does {name} live?", "person", "lives in", "country"),
    ("Who is the mayor of the city where {name} lives?", "person", "lives in", "mayor"),
    ("In which year was the city where {name} lives founded?", "person", "lives in",
     "founded"),
)


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def make_world(rng: random.Random, num_people: int = 12, num_cities: int = 5
               ) -> dict[str, dict[str, str]]:
    """{key: {field: value}}; names are unique across the whole world."""
    used: set[str] = set()

    def unique(make):
        while True:
            name = make()
            if name not in used and all(name not in u and u not in name for u in used):
                used.add(name)
                return name

    world: dict[str, dict[str, str]] = {}
    countries = [unique(lambda: _name(rng, 2) + "ia") for _ in range(3)]
    city_keys = [f"city/{i}" for i in range(num_cities)]
    for key in city_keys:
        world[key] = {"name": unique(lambda: _name(rng, 3)), "country": rng.choice(countries),
                      "founded": str(rng.randint(900, 1899))}
    for i in range(num_people):
        world[f"person/{i}"] = {
            "name": unique(lambda: f"{_name(rng, 2)} {_name(rng, 2)}"),
            "born": str(rng.randint(1930, 2005)), "lives in": rng.choice(city_keys)}
    people = [k for k in world if k.startswith("person/")]
    for key in city_keys:  # every city has a mayor; a mayor may live elsewhere
        residents = [p for p in people if world[p]["lives in"] == key]
        world[key]["mayor"] = rng.choice(residents or people)
    return world


def record_text(world: dict[str, dict[str, str]], key: str) -> str:
    return "\n".join(f"{field}: {value}" for field, value in world[key].items())


def search_world(world: dict[str, dict[str, str]], query: str) -> str:
    words = query.casefold().split()
    if not words:
        raise ValueError("empty query")
    hits = [key for key in world if all(w in record_text(world, key).casefold() for w in words)]
    if not hits:
        return "No results."
    return "\n".join(f"{key}: {world[key]['name']}" for key in hits[:MAX_SEARCH_RESULTS])


def get_record(world: dict[str, dict[str, str]], key: str) -> str:
    key = key.strip()
    if key not in world:
        raise ValueError(f"no record with key {key!r} (keys look like person/3 or city/1; "
                         "search for a name to find its key)")
    return record_text(world, key)


class LookupEnv(ToolEnv):
    """One world and one two-hop question per episode; see the module doc."""

    instructions = ("Answer the question about a small world of people and cities. Records "
                    "have keys like person/3 and city/1: search finds keys by name, get "
                    "returns a record. Then reply <answer>ANSWER</answer>.")

    def __init__(self, *, run_seed: int = 0, num_people: int = 12, num_cities: int = 5,
                 **tool_env_options: Any):
        if num_people < 1 or num_cities < 1:
            raise ValueError("num_people and num_cities must be >= 1")
        self.world: dict[str, dict[str, str]] = {}
        search = Tool(
            name="search", description="Find records whose text contains every word of the "
            "query. Returns up to 5 lines 'key: name'.",
            parameters={"type": "object", "properties": {"query": {
                "type": "string", "description": "words to look for, e.g. a name"}},
                "required": ["query"]},
            fn=lambda query: search_world(self.world, query))
        get = Tool(
            name="get", description="The record stored under a key, one 'field: value' "
            "per line.",
            parameters={"type": "object", "properties": {"key": {
                "type": "string", "description": "e.g. person/3"}}, "required": ["key"]},
            fn=lambda key: get_record(self.world, key))
        super().__init__([search, get], **tool_env_options)
        self.run_seed, self.num_people, self.num_cities = int(run_seed), num_people, num_cities

    def new_task(self, seed: int) -> tuple[str, str]:
        rng = random.Random(f"lookup:{self.run_seed}:{int(seed)}")
        self.world = make_world(rng, self.num_people, self.num_cities)
        question, kind, link, field = rng.choice(QUESTIONS)
        starts = [k for k in self.world if k.startswith(kind + "/")]
        rng.shuffle(starts)
        for start in starts:  # not a question that holds its answer (a mayor of their city)
            answer = self.world[self.world[start][link]][field]
            if field == "mayor":
                answer = self.world[answer]["name"]
            text = question.format(name=self.world[start]["name"])
            if answer not in text:
                return f"Question: {text}", answer
        raise AssertionError("unreachable: not every resident is their own city's mayor")


def _call(name: str, argument: str, value: str, call_style: str) -> str:
    return format_tool_call(name, {argument: value}, call_style)


def _fields(record: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in record.splitlines() if ": " in line)


class LookupOracle:
    """Answers every question from the messages alone (search, get, get, answer; the
    mayor's name takes one more get). `reply(new_text)` as `CalculatorOracle.reply`."""

    def __init__(self, call_style: str = "qwen"):
        self.call_style = call_style
        self.plan: tuple[str, str, str, str] | None = None
        self.name = ""
        self.records_seen = 0

    def reply(self, new_text: str) -> str:
        results = tool_responses(new_text)
        if not results:
            for question, kind, link, field in QUESTIONS:
                pattern = re.escape(question).replace(re.escape("{name}"), "(.+)")
                m = re.search(pattern, new_text)
                if m:
                    self.plan, self.name = (question, kind, link, field), m.group(1)
                    self.records_seen = 0
                    return _call("search", "query", self.name, self.call_style)
            return "<answer>unknown</answer>"
        _, kind, link, field = self.plan
        result = results[-1]
        if not result.startswith("name: "):  # search results: "key: name" lines
            for line in result.splitlines():
                key, _, name = line.partition(": ")
                if name == self.name and key.startswith(kind + "/"):
                    return _call("get", "key", key, self.call_style)
            return "<answer>unknown</answer>"
        fields = _fields(result)
        self.records_seen += 1
        if self.records_seen == 1:  # the named record: follow the link
            return _call("get", "key", fields[link], self.call_style)
        if self.records_seen == 2 and field == "mayor":  # the mayor is a key: get its name
            return _call("get", "key", fields["mayor"], self.call_style)
        return f"<answer>{fields['name'] if field == 'mayor' else fields[field]}</answer>"


def lookup_factory(*, num_people: int = 12, num_cities: int = 5, format_penalty: float = 0.1,
                   tool_error_penalty: float = 0.1, max_calls_per_turn: int = 3,
                   call_timeout_s: float = 1.0, max_steps_in_episode: int = 6,
                   max_tool_error_penalty: float = 0.5, call_style: str = "qwen",
                   extra_tools: tuple[str, ...] = (), mcp_servers: tuple[str, ...] = ()):
    """`make_python_env("lookup", **config)`: the episode factory."""
    options = dict(num_people=num_people, num_cities=num_cities, format_penalty=format_penalty,
                   tool_error_penalty=tool_error_penalty,
                   max_calls_per_turn=max_calls_per_turn, call_timeout_s=call_timeout_s,
                   max_steps_in_episode=max_steps_in_episode,
                   max_tool_error_penalty=max_tool_error_penalty, call_style=call_style,
                   extra_tools=tuple(extra_tools) + server_tools(mcp_servers, call_timeout_s))
    return tool_env_factory(LookupEnv, **options)

