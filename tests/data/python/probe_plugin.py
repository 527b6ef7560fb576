"""probe's test plugin: ASGI middleware for any Python server (vLLM's --middleware, or wrapped
around an app) that answers two routes of its own and passes every other request through.

GET /probe-test/spin?ms=N   pure-Python CPU work in probe_plugin_spin for N ms of wall time;
                            answers {"thread_cpu_s": the CPU time the function's thread spent in it}
GET /probe-test/block?ms=N  blocked in probe_plugin_block on a socket nobody writes to, N ms (its
                            timeout: no other thread of the server takes part in the wait);
                            answers {"blocked_s": how long the recv waited, "thread": the
                            blocked thread's name in `threading`, "native_id": its tid}

Both run on the event loop's thread, as a handler that forgot to await would.
"""
import json
import socket
import threading
import time


def probe_plugin_spin(ms):
    t0 = time.thread_time()
    end = time.monotonic() + ms / 1000.0
    x = 0
    while time.monotonic() < end:
        for i in range(1000):
            x += i * i
    return time.thread_time() - t0


def probe_plugin_block(ms):
    a, b = socket.socketpair()
    a.settimeout(ms / 1000.0)
    t0 = time.monotonic()
    try:
        a.recv(1)
    except socket.timeout:
        pass
    waited = time.monotonic() - t0
    a.close()
    b.close()
    return waited


class ProbeTestMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/probe-test/"):
            await self.app(scope, receive, send)
            return
        query = dict(p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p)
        ms = int(query.get("ms", "100"))
        if path == "/probe-test/spin":
            out = {"thread_cpu_s": probe_plugin_spin(ms)}
        elif path == "/probe-test/block":
            me = threading.current_thread()
            out = {"blocked_s": probe_plugin_block(ms), "thread": me.name, "native_id": me.native_id}
        else:
            out = {"error": "unknown route"}
        body = json.dumps(out).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
