"""A small MCP server over stdio for the tests of `jaxrl_agentic/envs/mcp_tools.py`.

    python tests/envs/mcp_test_server.py

Tools: `add` and `echo` answer; `fail` raises (an MCP error result); `hang` sleeps (a call
that outlives its timeout); `crash` ends the process mid-call (a server that died).

mcp 2.x renamed v1's `FastMCP` to `mcp.server.mcpserver.MCPServer` (same decorator API). A
tool that raises anything but `ToolError` comes back as "Error executing tool <name>" with its
message hidden, hence `fail` raises `ToolError`.
"""

from __future__ import annotations

import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("jaxrl-agentic-test-server", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def fail(message: str) -> str:
    """Always fails with the given message (an error result that carries it)."""
    raise ToolError(message)


@server.tool()
async def hang(seconds: float) -> str:
    """Sleep for `seconds`, then return "woke" (cancelled when the client gives up)."""
    await anyio.sleep(seconds)
    return "woke"


@server.tool()
def crash() -> str:
    """End the server process at once, mid-call."""
    os._exit(1)


if __name__ == "__main__":
    server.run("stdio")
