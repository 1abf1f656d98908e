"""A reverse proxy (HTTP, aiohttp) in front of the Ray dashboard that does not pass websockets, as many do.

Every plain request is forwarded to the dashboard and its answer sent back; a websocket upgrade
(the dashboard's log tail) is refused the way such proxies refuse it: `websockets="404"` or `"400"`
answers with that status, `"hang"` never answers, `"slow"` passes it but holds each message
`slow_s` seconds (a stream that lags behind its log). `fail_gets(n)` answers the next n GETs
with HTTP 500 before forwarding resumes. What it sent back is counted per request path.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"}


class NoWebsocketProxy:
    def __init__(self, target_url: str, websockets: str = "404", slow_s: float = 0.05) -> None:
        self.target = target_url.rstrip("/")
        self.websockets = websockets
        self.slow_s = slow_s
        self.port = 0
        self.sent: Counter[str] = Counter()  # bytes sent back, per request path
        self.requests: list[str] = []  # "METHOD path" of every request, websocket upgrades included
        self._fail = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closing = asyncio.Event()  # set when the proxy stops

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bytes_of(self, path: str) -> int:
        return self.sent[path]

    def bytes_to(self, prefix: str) -> int:
        return sum(n for path, n in self.sent.items() if path.startswith(prefix))

    def fail_gets(self, count: int) -> None:
        self._fail = count

    def __enter__(self) -> NoWebsocketProxy:
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        assert self._runner is not None and self._session is not None
        self._closing.set()
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        if request.headers.get("Upgrade", "").lower() == "websocket":
            if self.websockets == "slow":
                return await self._slow_websocket(request)
            if self.websockets == "hang":
                await self._closing.wait()  # never answered while the proxy runs
            status = 502 if self.websockets == "hang" else int(self.websockets)
            return self._count(request, web.Response(status=status, text="websockets are not proxied"))
        if request.method == "GET" and self._fail > 0:
            self._fail -= 1
            return self._count(request, web.Response(status=500, text="proxy: upstream error"))
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with self._session.request(request.method, self.target + request.path_qs, headers=headers,
                                         data=await request.read(), allow_redirects=False) as upstream:
            body = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            return self._count(request, web.Response(status=upstream.status, body=body, headers=out))

    def _count(self, request: web.Request, response: web.Response) -> web.Response:
        self.sent[request.path] += len(response.body or b"")
        return response

    async def _slow_websocket(self, request: web.Request) -> web.WebSocketResponse:
        assert self._session is not None
        client = web.WebSocketResponse(max_msg_size=0)
        await client.prepare(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        async with self._session.ws_connect(self.target.replace("http", "ws", 1) + request.path_qs,
                                            headers=headers, max_msg_size=0) as upstream:
            async for message in upstream:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                await asyncio.sleep(self.slow_s)
                self.sent[request.path] += len(message.data.encode())
                await client.send_str(message.data)
        await client.close()
        return client
