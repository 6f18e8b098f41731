"""The OpenAI-compatible HTTP endpoint, on 127.0.0.1 in the training process (aiohttp).

    POST /episodes/<key>/v1/chat/completions     an episode's requests (base_url per episode)
    GET  /episodes/<key>/v1/models
    POST /v1/chat/completions                    the same, the episode named by the API key
    GET  /v1/models                                (``Authorization: Bearer <key>``)

Each episode a rollout opens gets a random key, used both as its URL path segment and as
its API key, so the requests of many agents running at once are attributed to their own
episodes. The server runs on its own thread and event loop; a request is checked there
(`protocol.parse_chat_request`) and handed to its episode's rollout (`open_episode`'s
`submit`, which returns a `concurrent.futures.Future` of the reply body); the handler awaits
it, so the server never blocks on decoding. Errors are OpenAI error bodies: 400 for a bad
request (malformed JSON, n≠1, ...), 401 without a key, 404 for an unknown or finished
episode.

aiohttp is the optional extra ``[serve]`` (``pip install jaxrl_agentic[serve]``); it is
imported when a server starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import threading
from collections.abc import Callable

from jaxrl_agentic.serving.protocol import (
    ChatRequest,
    RequestError,
    models_body,
    parse_chat_request,
)

Submit = Callable[[ChatRequest], concurrent.futures.Future]
DEFAULT_MODEL_NAME = "jaxrl_agentic-policy"


class AgentServer:
    """The endpoint (module doc); `start` binds it (port 0: any free port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = DEFAULT_MODEL_NAME):
        self.host, self.port, self.model_name = host, int(port), model_name
        self._episodes: dict[str, Submit] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, key: str) -> str:
        """The OpenAI ``base_url`` of episode `key`."""
        return f"{self.url}/episodes/{key}/v1"

    def open_episode(self, submit: Submit) -> str:
        """Routes a new episode's requests to `submit`; → its key (path segment, API key)."""
        key = secrets.token_hex(12)
        with self._lock:
            self._episodes[key] = submit
        return key

    def close_episode(self, key: str) -> None:
        """Its later requests get a 404."""
        with self._lock:
            self._episodes.pop(key, None)

    def start(self) -> AgentServer:
        """Binds and serves on a daemon thread (once; later calls return at once)."""
        if self._thread is not None:
            return self
        try:
            from aiohttp import web
        except ImportError:
            raise RuntimeError("the OpenAI-compatible endpoint needs aiohttp: pip install "
                               "'jaxrl_agentic[serve]'") from None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(web, ready), daemon=True,
                                        name="openai-endpoint")
        self._thread.start()
        self.port = ready.result(timeout=60)
        return self

    def _serve(self, web, ready: concurrent.futures.Future) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/episodes/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{key}/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        try:
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            port = self._runner.addresses[0][1]
        except BaseException as e:
            ready.set_exception(e)
            return
        ready.set_result(port)
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def close(self) -> None:
        """Stops serving (requests in flight are dropped)."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._thread = self._loop = None

    # ---- handlers -----------------------------------------------------------------------

    def _key(self, request) -> str:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            if not auth.startswith("Bearer ") or not auth[len("Bearer "):].strip():
                raise RequestError(401, "no API key: send the episode's key as "
                                   "'Authorization: Bearer <key>' or use its base_url",
                                   code="invalid_api_key", kind="authentication_error")
            key = auth[len("Bearer "):].strip()
        return key

    def _submit(self, key: str) -> Submit:
        with self._lock:
            submit = self._episodes.get(key)
        if submit is None:
            raise RequestError(404, f"no open episode {key[:32]!r} (unknown, or its agent "
                               "has finished)", code="episode_not_found")
        return submit

    async def _chat(self, request):
        from aiohttp import web

        try:
            submit = self._submit(self._key(request))
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise RequestError(400, f"the request body is not valid JSON ({e})",
                                   code="invalid_json") from None
            reply = await asyncio.wrap_future(submit(parse_chat_request(body)))
        except RequestError as e:
            return web.json_response(e.body(), status=e.status)
        except Exception as e:  # the rollout failed on this request: say so, as OpenAI does
            error = RequestError(500, f"the endpoint failed: {type(e).__name__}: {e}",
                                 kind="server_error")
            return web.json_response(error.body(), status=500)
        if not reply.get("model"):
            reply["model"] = self.model_name
        return web.json_response(reply)

    async def _models(self, request):
        from aiohttp import web

        try:
            self._submit(self._key(request))
        except RequestError as e:
            return web.json_response(e.body(), status=e.status)
        return web.json_response(models_body(self.model_name))


_SHARED: AgentServer | None = None
_SHARED_LOCK = threading.Lock()


def shared_server() -> AgentServer:
    """The process's endpoint, started on first use (all rollouts share it)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = AgentServer().start()
        return _SHARED
