"""The tools of MCP servers reached over stdio, as this project's `Tool`s.

    tools = mcp_tools(["python path/to/server.py", "npx some-mcp-server --flag"])
    # → [Tool(name, description, parameters=<the server's inputSchema>, fn), ...]

Each command (a shell-like string, split with `shlex`) starts one server process per Python
process (`mcp_tools` keeps a module-level cache keyed by the split command), talked to by
`MCPServer`: an asyncio event loop on a daemon thread holds the `mcp` `ClientSession`, and the
synchronous `Tool.fn(**arguments)` sends `tools/call` on that loop and waits for the answer.
The text blocks of the result are the tool message (joined by newlines).

Failures end the call, never the caller. Those of the call `ToolEnv` counts as tool errors
of the model (`envs/tools.py`'s `run_tool_call` turns the exception into an `Error: …` tool
message, charged `tool_error_penalty`):

- the server answers with an error result (`isError`) or a JSON-RPC error: `MCPToolError`
  carrying the server's message; the server stays in use;
- no answer within `call_timeout_s` (0 = no deadline): `TimeoutError` (the request is
  abandoned with a `notifications/cancelled`, the server stays in use). `ToolEnv`'s own
  `call_timeout_s`, when shorter, abandons the call first and counts it in `tool_timeouts`
  too.

The server process died (crashed, exited, closed its stdout): `MCPServerError`, a
`ToolUnavailableError`. That is the infrastructure's fault, not the model's: it raises out
of `ToolEnv.step`, and the rollout ends the episode as an environment error (`env/errors`).
Every later call of that `MCPServer` fails at once with the same message. The tools
`mcp_tools` returns go through the process's server of their command instead: one that died
is started again in the background, outside any call's deadline, at most `max_restarts`
times (`MAX_RESTARTS`, each restart logged with its count); the calls made meanwhile, and
every call once the restarts are spent, raise `MCPServerError` at once. The call the server
died in is not retried (it may be what killed the server).

`mcp` is imported inside the functions that need it: importing this module never needs it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import dataclasses
import json
import logging
import shlex
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from jaxrl_agentic.envs.tools import MAX_RESULT_CHARS, Tool, ToolUnavailableError

# Extra wait past the session's own read timeout before a call is given up from this side.
_GRACE_S = 1.0
# Bound on `close()`: the SDK's stdio shutdown waits at most ~6.5 s for a stubborn server.
_CLOSE_TIMEOUT_S = 10.0
_MCP_MISSING = "mcp_servers needs the mcp package: pip install -e '.[envs]'"
_DEFAULT_CALL_TIMEOUT_S = 5.0
# Restarts of a dead server per `mcp_tools` call (a tool environment's factory): enough for
# a server that crashes now and then; one that dies at every start stops costing time.
MAX_RESTARTS = 3
_log = logging.getLogger(__name__)


class MCPServerError(ToolUnavailableError):
    """The server cannot answer: it failed to start, died, or was closed (no fault of the
    call, hence a `ToolUnavailableError`)."""


class MCPToolError(RuntimeError):
    """The server answered the call with an error (an `isError` result or a JSON-RPC error)."""


def _require_mcp():
    try:
        import mcp
    except ImportError as exc:
        raise ImportError(_MCP_MISSING) from exc
    return mcp


def _one_line(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " …(cut)"


def _split(command: str) -> tuple[str, ...]:
    if not isinstance(command, str):
        raise TypeError(f"an MCP server command must be a str, got {type(command).__name__}")
    argv = tuple(shlex.split(command))
    if not argv:
        raise ValueError("an MCP server command must not be empty")
    return argv


def _stderr() -> TextIO:
    """Where the server's stderr goes: ours, if it is a real file (pytest may swap it)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.fileno()
                return stream
        except (AttributeError, OSError, ValueError):
            continue
    raise MCPServerError("no stderr file to hand to the MCP server process")


def _result_text(result: Any) -> str:
    """The text of a `CallToolResult`: its text blocks joined by newlines; a text resource
    counts as text, other blocks as `[type]`; with no blocks, the structured content as JSON."""
    parts = []
    for block in result.content or ():
        text = getattr(block, "text", None)
        if text is None:  # an embedded text resource carries its text one level down
            text = getattr(getattr(block, "resource", None), "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


class MCPServer:
    """One MCP server process over stdio and its client session, used synchronously.

    `command` is split with `shlex` (`"python server.py --flag"`). The server must answer
    the handshake within `startup_timeout_s`, or the constructor raises `MCPServerError`
    (and the process is stopped); `tools/list` gets as long. Each `tools/call` gets
    `call_timeout_s` (0 = no deadline), unless the call names its own.
    `env` adds variables over the SDK's default environment of the child (PATH, HOME, …
    only); `cwd` is its working directory; `errlog` receives its stderr (default ours).

    Safe to call from several threads at once (the calls run concurrently on the loop).
    `close()` is idempotent and registered with `atexit`.
    """

    def __init__(self, command: str, *, startup_timeout_s: float = 10.0,
                 call_timeout_s: float = _DEFAULT_CALL_TIMEOUT_S,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 errlog: TextIO | None = None):
        self._failure: str | None = None  # set once the server cannot answer any more
        self._closed = False
        self._closed_running = False  # close() stopped it, not a crash
        self.argv = _split(command)
        self.command = command
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        if not call_timeout_s >= 0:
            raise ValueError(f"call_timeout_s must be >= 0 (0 = no deadline), got "
                             f"{call_timeout_s}")
        self.startup_timeout_s, self.call_timeout_s = float(startup_timeout_s), float(
            call_timeout_s)
        mcp = _require_mcp()
        self._params = mcp.StdioServerParameters(
            command=self.argv[0], args=list(self.argv[1:]),
            env=dict(env) if env is not None else None, cwd=cwd)
        self._errlog = errlog if errlog is not None else _stderr()
        self._session: Any = None
        self._lock = threading.Lock()
        self._stop = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, daemon=True,
                                        name=f"mcp-{self.argv[0]}")
        self._thread.start()
        atexit.register(self.close)
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        try:
            ready.result(timeout=self.startup_timeout_s + _GRACE_S)
        except BaseException as exc:
            self.close()
            if isinstance(exc, concurrent.futures.TimeoutError):
                reason = f"no answer within {self.startup_timeout_s:g} s"
            else:
                reason = _describe(exc)
            raise MCPServerError(f"MCP server {command!r} failed to start: {reason}") from None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "running")
        return f"MCPServer({self.command!r}, {state})"

    @property
    def alive(self) -> bool:
        """Whether calls still go to the server (not closed, not known dead)."""
        return self._failure is None

    @property
    def died(self) -> bool:
        """Whether the server stopped answering by itself (crashed, exited, killed) rather
        than by `close()`: what a restart is for."""
        return self._failure is not None and not self._closed_running

    @property
    def failure(self) -> str | None:
        """Why the server cannot answer (None while it can)."""
        return self._failure

    # ---- the loop thread ----------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        """Holds the transport and the session open until `close()` or a failure."""
        import anyio
        from mcp import ClientSession, stdio_client

        try:
            async with stdio_client(self._params, errlog=self._errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    with anyio.fail_after(self.startup_timeout_s):
                        await session.initialize()
                    self._session = session
                    ready.set_result(None)
                    await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # anyio may wrap the failure in an exception group
            if not ready.done():
                ready.set_exception(exc)
            elif self._failure is None:
                self._failure = (f"MCP server {self.command!r} is not running "
                                 f"({_describe(exc)})")
        finally:
            self._session = None
            if not ready.done():
                ready.set_exception(MCPServerError("the session ended before it started"))
            if self._failure is None:
                self._failure = f"MCP server {self.command!r} is not running (session ended)"

    def _run(self, coro, timeout_s: float) -> Any:
        """Runs `coro` on the loop and waits for it at most `timeout_s` (+ grace; 0 = as
        long as it takes)."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise MCPServerError(self._failure or f"MCP server {self.command!r} is closed") \
                from None
        try:
            return future.result(timeout=timeout_s + _GRACE_S if timeout_s > 0 else None)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise MCPServerError(self._failure or f"MCP server {self.command!r} is closed") \
                from None

    def _fail(self, reason: str) -> MCPServerError:
        """Marks the server dead (later calls fail at once) and lets the session unwind."""
        if self._failure is None:
            self._failure = f"MCP server {self.command!r} is not running ({reason})"
        self._signal_stop()
        return MCPServerError(self._failure)

    def _signal_stop(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:  # the loop is already closed
            pass

    # ---- the synchronous API ------------------------------------------------------------

    def _checked_session(self) -> Any:
        session = self._session
        if self._failure is not None or session is None:
            raise MCPServerError(self._failure or f"MCP server {self.command!r} is not running")
        return session

    def list_tools(self) -> list[Tool]:
        """The server's tools as `Tool`s: name, description, `inputSchema` as `parameters`,
        and `fn(**arguments)` that calls the tool on the server (`call_tool`)."""
        session = self._checked_session()

        async def listing():
            from mcp.types import PaginatedRequestParams

            tools, cursor = [], None
            while True:
                params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
                page = await session.list_tools(params=params)
                tools.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    return tools

        try:
            listed = self._run(listing(), self.startup_timeout_s)
        except Exception as exc:
            raise self._error("tools/list", exc, self.startup_timeout_s) from None
        return [_as_tool(t, self.call_tool) for t in listed]

    def call_tool(self, name: str, arguments: Mapping[str, Any] | None = None, *,
                  timeout_s: float | None = None) -> str:
        """Calls tool `name` on the server; returns the text of its result. `timeout_s`:
        this call's deadline (None = the server's `call_timeout_s`; 0 = none).

        Raises `MCPToolError` (the server's error), `TimeoutError` (no answer in time) or
        `MCPServerError` (the server is gone), each with a one-line message."""
        timeout_s = self.call_timeout_s if timeout_s is None else float(timeout_s)
        session = self._checked_session()
        coro = session.call_tool(name, dict(arguments or {}),
                                 read_timeout_seconds=timeout_s if timeout_s > 0 else None)
        try:
            result = self._run(coro, timeout_s)
        except Exception as exc:
            raise self._error(name, exc, timeout_s) from None
        if result.is_error:
            text = _result_text(result)
            raise MCPToolError(_one_line(text) if text.strip()
                               else f"the MCP tool {name} returned an error")
        return _result_text(result)

    def _error(self, what: str, exc: BaseException, timeout_s: float) -> Exception:
        """The exception a failed request (with deadline `timeout_s`) raises to the caller."""
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        if isinstance(exc, MCPServerError):
            return exc
        if isinstance(exc, TimeoutError) or (isinstance(exc, MCPError)
                                             and exc.code == REQUEST_TIMEOUT):
            return TimeoutError(f"MCP tool {what} timed out after {timeout_s:g} s")
        if isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED:
            return self._fail("connection closed")
        if isinstance(exc, MCPError):  # a JSON-RPC error answer: unknown tool, bad params, ...
            return MCPToolError(_one_line(f"{what}: {exc.message}"))
        if self._serving.done():  # the session itself is gone
            return self._fail(_describe(exc))
        return MCPToolError(_one_line(f"{what} failed: {_describe(exc)}"))

    def close(self) -> None:
        """Ends the session and stops the server process; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._failure is None:
            self._closed_running = True
            self._failure = f"MCP server {self.command!r} is closed"
        atexit.unregister(self.close)
        if self._loop.is_closed():
            return
        self._signal_stop()
        try:
            self._serving.result(timeout=_CLOSE_TIMEOUT_S)
        except BaseException:  # failures were recorded by `_serve`; a stuck shutdown is left
            pass
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:
            return
        self._thread.join(timeout=_CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> MCPServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _as_tool(info: Any, call) -> Tool:
    """The `Tool` of a listed MCP tool `info`, its `fn(**arguments)` = `call(name, arguments)`."""
    return Tool(name=info.name, description=info.description or info.title or "",
                parameters=copy.deepcopy(dict(info.input_schema)), fn=_bound(call, info.name))


def _bound(call, name: str):
    def fn(**arguments: Any) -> str:
        return call(name, arguments)

    fn.__name__ = fn.__qualname__ = f"mcp_{name}"
    return fn


def _describe(exc: BaseException) -> str:
    """One line naming an exception; an exception group shows its first leaf."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        exc = exc.exceptions[0]
    message = _one_line(str(exc), limit=300)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


# ---- one server per command per process -----------------------------------------------------

_SERVERS: dict[tuple[str, ...], MCPServer] = {}
_SERVERS_LOCK = threading.Lock()


def mcp_server(command: str, **kwargs: Any) -> MCPServer:
    """The process's `MCPServer` for `command` (keyed by its `shlex` split), started on first
    use; a server that died or was closed is replaced by a fresh one. `kwargs` (those of
    `MCPServer`) apply only when a server is started."""
    key = _split(command)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive:
            if server is not None:
                server.close()
            server = _SERVERS[key] = MCPServer(command, **kwargs)
        return server


class _RestartingServer:
    """The process's server of one command (`mcp_server`) as the tools of one `mcp_tools`
    call reach it, restarted when it died.

    A call that finds the server dead (`died`: not closed on purpose), or in which it
    dies, raises `MCPServerError` at once and starts a restart on a daemon thread (one at a
    time, at most `max_restarts` in all, each logged with its count); calls while it runs
    raise too, and a fresh server another handle started for the command is taken over. The
    restart is never waited for inside a call: a server takes seconds to start, longer than
    a tool environment's `call_timeout_s`, and that deadline would charge the model a
    timeout for the infrastructure's time. A restart that fails to start is tried again at
    a later call while restarts are left. Each call has the deadline `call_timeout_s` of the
    `kwargs` this handle was made with, whoever started the server."""

    def __init__(self, command: str, max_restarts: int, kwargs: Mapping[str, Any]):
        self.command, self.max_restarts, self.kwargs = command, int(max_restarts), dict(kwargs)
        self.call_timeout_s = float(self.kwargs.get("call_timeout_s", _DEFAULT_CALL_TIMEOUT_S))
        self.restarts = 0
        self._lock = threading.Lock()
        self._restarting: threading.Thread | None = None
        self.server = mcp_server(command, **self.kwargs)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        with self._lock:
            server = self._current()
        try:
            return server.call_tool(name, arguments, timeout_s=self.call_timeout_s)
        except MCPServerError:
            with self._lock:
                if self.server is server and server.died:
                    raise self._restart_soon(server) from None
            raise

    def _current(self) -> MCPServer:
        """The server to call (the caller holds the lock); raises when it died."""
        server = self.server
        if server.alive:
            return server
        with _SERVERS_LOCK:
            cached = _SERVERS.get(_split(self.command))
        if cached is not None and cached is not server and cached.alive:
            self.server = cached  # started by another handle, or by `mcp_server`
            return cached
        if not server.died:  # closed on purpose: its calls say so
            return server
        raise self._restart_soon(server)

    def _restart_soon(self, dead: MCPServer) -> MCPServerError:
        """Starts restarting `dead` unless a restart runs or none is left (the caller holds
        the lock); the error of the call that found it dead."""
        if self._restarting is not None and self._restarting.is_alive():
            return MCPServerError(f"{dead.failure}; restarting it")
        if self.restarts >= self.max_restarts:
            n = self.restarts
            return MCPServerError(f"{dead.failure}; not restarted again ({n} restart"
                                  f"{'' if n == 1 else 's'} spent)")
        self.restarts += 1
        _log.warning("%s; restarting it (restart %d of %d)", dead.failure, self.restarts,
                     self.max_restarts)
        self._restarting = threading.Thread(target=self._restart, daemon=True,
                                            name=f"mcp-restart-{self.command}")
        with _RESTARTS_LOCK:
            _RESTARTS.add(self._restarting)
        self._restarting.start()
        return MCPServerError(f"{dead.failure}; restarting it (restart {self.restarts} of "
                              f"{self.max_restarts})")

    def _restart(self) -> None:
        try:
            server = mcp_server(self.command, **self.kwargs)  # replaces the dead one
        except Exception as exc:  # MCPServerError: it did not start; a later call retries
            _log.warning("%s", exc)
        else:
            with self._lock:
                self.server = server
        finally:
            with _RESTARTS_LOCK:
                _RESTARTS.discard(threading.current_thread())


_RESTARTS: set[threading.Thread] = set()
_RESTARTS_LOCK = threading.Lock()


def wait_for_restarts(timeout_s: float | None = None) -> None:
    """Waits (at most `timeout_s` per restart) until the restarts of dead servers that are
    under way have ended, started or not."""
    with _RESTARTS_LOCK:
        threads = list(_RESTARTS)
    for thread in threads:
        thread.join(timeout_s)


def mcp_tools(commands: Sequence[str], *, max_restarts: int = MAX_RESTARTS,
              **kwargs: Any) -> list[Tool]:
    """The tools of the MCP servers started by `commands` (`mcp_server`), in order; a command
    given twice counts once. Two servers offering one tool name: ValueError naming both.
    A server found dead at a call is restarted, up to `max_restarts` times per command
    (module docstring); `kwargs` are `MCPServer`'s, and their `call_timeout_s` is the
    deadline of these tools' calls."""
    if isinstance(commands, str):
        raise TypeError("mcp_tools takes a sequence of commands, not one str")
    if not (isinstance(max_restarts, int) and max_restarts >= 0):
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    tools: list[Tool] = []
    owner: dict[str, str] = {}
    seen: set[tuple[str, ...]] = set()
    for command in commands:
        key = _split(command)
        if key in seen:
            continue
        seen.add(key)
        handle = _RestartingServer(command, max_restarts, kwargs)
        for tool in handle.server.list_tools():
            if tool.name in owner:
                raise ValueError(f"MCP tool {tool.name!r} is offered by two servers: "
                                 f"{owner[tool.name]!r} and {command!r}")
            owner[tool.name] = command
            tools.append(dataclasses.replace(tool, fn=_bound(handle.call_tool, tool.name)))
    return tools


def server_tools(commands: Sequence[str], call_timeout_s: float,
                 max_restarts: int = MAX_RESTARTS) -> tuple[Tool, ...]:
    """A tool environment's `mcp_servers` as tools for its `extra_tools` (`mcp_tools`; none
    without commands, and then `mcp` is not imported). Their calls have the environment's
    `call_timeout_s` (0 = none) as the server's deadline too, so a call the environment
    gives up on is cancelled; a dead server is restarted up to `max_restarts` times."""
    if not commands:
        return ()
    return tuple(mcp_tools(tuple(commands), max_restarts=max_restarts,
                           call_timeout_s=call_timeout_s))


def close_mcp_servers() -> None:
    """Closes every server `mcp_server` started, restarts under way included (they also
    close at exit)."""
    wait_for_restarts(_CLOSE_TIMEOUT_S)
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.close()
