"""An OpenAI-compatible endpoint in the training process, so that agents written elsewhere
can be trained: the agent points its ``base_url`` at the trainer, the trainer answers from
its own policy and keeps the exact tokens and logprobs it sampled, and the agent's result
is the episode's reward (env type ``openai_agent``, `envs/outside_agent.py`).

    protocol.py      the chat-completions wire format: requests checked, replies and errors
    server.py        AgentServer: aiohttp on 127.0.0.1, one URL path / API key per episode
    streams.py       AgentEpisode: continuations appended as tokens, rewritten histories
                     split into new samples
    slots.py         SlotPool: the requests of many agents decoded together (continuous
                     batching over the sampler's rows); SessionPool for other backends
    agent_runner.py  AgentRolloutRunner: agents on threads, rewards, trajectories

docs/outside_agents.md shows an agent and the recipe fields.
"""

from jaxrl_agentic.serving.agent_runner import AgentRolloutRunner, agent_rollout_runner
from jaxrl_agentic.serving.protocol import ChatRequest, RequestError, parse_chat_request
from jaxrl_agentic.serving.server import AgentServer, shared_server
from jaxrl_agentic.serving.streams import AgentEpisode

__all__ = [
    "AgentEpisode",
    "AgentRolloutRunner",
    "AgentServer",
    "ChatRequest",
    "RequestError",
    "agent_rollout_runner",
    "parse_chat_request",
    "shared_server",
]
