#!/usr/bin/env python3
"""One streamed generation request, made the way a real client makes it; prints what the client
saw as one JSON line (the ground truth the client matrix test compares probe's verdict with).

Clients differ in how they end a stream, which is what the matrix is about:
  openai    the `openai` Python SDK, streaming; breaks out of its loop at the final chunk and
            closes the stream (before `[DONE]` and the terminal chunk), as SDK loops do
  httpx     httpx streaming lines; leaves at the final event (the `with` block closes it)
  requests  requests streaming; reads to the end of the response, then closes
  curl      `curl -sN`; reads to the end (a leaver closes curl's pipe and ends it)
  raw       a plain socket; closes the moment the final event has arrived (unread bytes: reset)
  keepalive http.client, pooled: a health check, then the request on the same connection, then a
            second request reusing it (reconnecting if the server dropped it)

--api chat: POST /v1/chat/completions (OpenAI deltas, finish_reason). --api native: llama.cpp's
POST /completion (`"stop": true`, `stop_type`). --leave-after K: leave after K content events.
Request text is fixed; nothing here is printed but counts and stop fields.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

PROMPTS = {
    "short": "What is the capital of France? Answer in one word.",
    "long": "Write a very long story about a lighthouse keeper and the sea.",
    "count": "Count from 1 to 30, separated by commas: 1, 2, 3,",
}


def body(a, max_tokens):
    b = {"max_tokens": max_tokens, "stream": True, "temperature": 0, "seed": 42}
    if a.ignore_eos:
        b["ignore_eos"] = True
    if a.stop:
        b["stop"] = [a.stop]
    if a.api == "chat":
        b["messages"] = [{"role": "user", "content": PROMPTS[a.prompt]}]
        b["model"] = a.model
        path = "/v1/chat/completions"
    else:
        b["prompt"] = PROMPTS[a.prompt]
        b["n_predict"] = max_tokens
        path = "/completion"
    return path, b


def context_exceeded(msg):
    """The server's context (a slot's, or a KV pool the slots share) ran out."""
    m = str(msg).lower()
    return "context" in m and any(w in m for w in ("exceed", "too long", "full"))


class Seen:
    """What one request showed the client."""

    def __init__(self, max_tokens):
        self.d = {"max_tokens": max_tokens, "status": None, "content_events": 0, "finish_reason": None,
                  "stop_type": None, "stop_reason": None, "done": False, "left_early": False, "error": None}

    def event(self, data):
        """One SSE data payload; returns True when it is the server's final message."""
        if data.strip() == "[DONE]":
            self.d["done"] = True
            return True
        try:
            v = json.loads(data)
        except ValueError:
            return False
        if "error" in v:
            e = v["error"]
            self.d["error"] = str(e.get("type") if isinstance(e, dict) else "error")
            self.d["context_exceeded"] = context_exceeded(e.get("message", "") if isinstance(e, dict) else e)
            return True
        final = False
        ch = (v.get("choices") or [None])[0]
        if ch is not None:
            delta = ch.get("delta") or {}
            if delta.get("content") or ch.get("text"):
                self.d["content_events"] += 1
            if ch.get("finish_reason"):
                self.d["finish_reason"] = ch["finish_reason"]
                self.d["stop_reason"] = ch.get("stop_reason")
                final = True
        elif "content" in v:
            if v.get("content"):
                self.d["content_events"] += 1
            if v.get("stop"):
                self.d["stop_type"] = v.get("stop_type")
                final = True
        return final

    def leave(self, a):
        if self.d["content_events"] and a.ready_file:
            # Tell the test this stream is flowing (it pauses or kills the server only then).
            open(a.ready_file, "a").close()
            a.ready_file = None
        if a.leave_after and self.d["content_events"] >= a.leave_after:
            self.d["left_early"] = True
            return True
        return False


def sse_lines(lines, seen, a, stop_at_final):
    """Feed decoded SSE lines; returns when the client decides to stop reading."""
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        line = line.rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        final = seen.event(line[5:].strip())
        if seen.leave(a):
            return
        if final and stop_at_final:
            return


def run_openai(a, max_tokens):
    import openai

    seen = Seen(max_tokens)
    path, b = body(a, max_tokens)
    extra = {k: b[k] for k in ("ignore_eos", "seed", "n_predict") if k in b}
    if a.api == "chat":
        client = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.chat.completions.create(model=a.model, messages=b["messages"], max_tokens=max_tokens, stream=True,
                                                temperature=0, stop=b.get("stop"), extra_body=extra)
    else:
        # llama.cpp's native endpoint is also served at /completions: the SDK's completions call
        # with the server's root as base URL reaches it.
        client = openai.OpenAI(base_url=a.url, api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(model=a.model, prompt=b["prompt"], max_tokens=max_tokens, stream=True,
                                           temperature=0, stop=b.get("stop"), extra_body=extra)
    seen.d["status"] = stream.response.status_code
    try:
        for chunk in stream:
            data = chunk.model_dump_json() if hasattr(chunk, "model_dump_json") else json.dumps(chunk)
            final = seen.event(data)
            if seen.leave(a) or final:
                break  # the SDK loop ends at the final chunk, as user code does
    except Exception as e:  # a stream cut by a gateway or a dead server, an error event
        seen.d["error"] = type(e).__name__
        seen.d["context_exceeded"] = context_exceeded(e)
    stream.close()
    client.close()
    return seen.d


def run_httpx(a, max_tokens):
    import httpx

    seen = Seen(max_tokens)
    path, b = body(a, max_tokens)
    with httpx.Client(timeout=120) as c:
        try:
            with c.stream("POST", a.url + path, json=b) as r:
                seen.d["status"] = r.status_code
                sse_lines(r.iter_lines(), seen, a, stop_at_final=True)
        except httpx.HTTPError as e:
            seen.d["error"] = type(e).__name__
    return seen.d


def run_requests(a, max_tokens):
    import requests

    seen = Seen(max_tokens)
    path, b = body(a, max_tokens)
    try:
        with requests.post(a.url + path, json=b, stream=True, timeout=120) as r:
            seen.d["status"] = r.status_code
            sse_lines(r.iter_lines(), seen, a, stop_at_final=False)
    except requests.RequestException as e:
        seen.d["error"] = type(e).__name__
    return seen.d


def run_curl(a, max_tokens):
    seen = Seen(max_tokens)
    path, b = body(a, max_tokens)
    p = subprocess.Popen(["curl", "-sN", "-w", "\nstatus=%{http_code}\n", "-H", "Content-Type: application/json",
                          "--data-binary", json.dumps(b), a.url + path], stdout=subprocess.PIPE)
    lines = iter(p.stdout.readline, b"")
    for line in lines:
        text = line.decode("utf-8", "replace")
        if text.startswith("status="):
            seen.d["status"] = int(text.split("=")[1])
        elif text.startswith("data:"):
            seen.event(text[5:].strip())
            if seen.leave(a):
                # Like `curl -N ... | head`: the reader goes away and curl ends.
                p.stdout.close()
                p.terminate()
                break
    rc = p.wait()
    if rc not in (0, -15) and not seen.d["left_early"]:
        seen.d["error"] = "curl exit %d" % rc
    if seen.d["status"] is None and not seen.d["left_early"]:
        seen.d["status"] = 200 if seen.d["content_events"] else None
    return seen.d


def raw_request(a, path, b, keep_alive):
    u = urlsplit(a.url)
    s = socket.create_connection((u.hostname, u.port), timeout=120)
    data = json.dumps(b).encode()
    head = "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: %s\r\n\r\n" % (
        path, u.netloc, len(data), "keep-alive" if keep_alive else "close")
    s.sendall(head.encode() + data)
    return s


def run_raw(a, max_tokens):
    seen = Seen(max_tokens)
    path, b = body(a, max_tokens)
    s = raw_request(a, path, b, keep_alive=True)
    buf = b""
    try:
        while True:
            got = s.recv(65536)
            if not got:
                break
            buf += got
            if seen.d["status"] is None and b"\r\n" in buf:
                seen.d["status"] = int(buf.split(b" ", 2)[1])
            # Events are read from the raw bytes (chunk-size lines are not `data:` lines).
            done = False
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    line = line.strip()
                    if line.startswith(b"data:"):
                        final = seen.event(line[5:].decode("utf-8", "replace").strip())
                        if seen.leave(a) or final:
                            done = True
                if done:
                    break
            if done:
                break
    except OSError as e:
        seen.d["error"] = type(e).__name__
    s.close()  # right after the final event: the rest of the response is never read
    return seen.d


def run_keepalive(a, max_tokens):
    """A pooled client: a health check, then the request on the same connection, then a second
    one reusing it. A server that closed the connection after a streamed response (llama-server
    does) is reconnected to, as urllib3 and curl do."""
    import http.client

    u = urlsplit(a.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("GET", "/health")
    conn.getresponse().read()
    out = []
    for n in (max_tokens, max_tokens + 10):
        seen = Seen(n)
        path, b = body(a, n)
        for attempt in (0, 1):
            try:
                conn.request("POST", path, json.dumps(b), {"Content-Type": "application/json"})
                r = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if attempt:
                    raise
                conn.close()
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
                seen.d["reconnected"] = True
        seen.d["status"] = r.status
        try:
            for line in r:
                sse_lines([line], seen, a, stop_at_final=False)
                if seen.d["left_early"]:
                    break
        except (OSError, http.client.HTTPException) as e:
            seen.d["error"] = type(e).__name__
        said = seen.d["finish_reason"] or seen.d["stop_type"] or seen.d["done"] or seen.d["error"]
        if not said and not seen.d["left_early"]:
            seen.d["error"] = "incomplete"  # the response ended without the server's final message
        out.append(seen.d)
        if seen.d["left_early"] or seen.d["error"]:
            break
        r.read()
    conn.close()
    return out


RUN = {"openai": run_openai, "httpx": run_httpx, "requests": run_requests, "curl": run_curl, "raw": run_raw, "keepalive": run_keepalive}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client", required=True, choices=sorted(RUN))
    p.add_argument("--url", required=True)
    p.add_argument("--api", choices=["chat", "native"], default="chat")
    p.add_argument("--model", default="model")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--prompt", choices=sorted(PROMPTS), default="short")
    p.add_argument("--stop")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--leave-after", type=int, default=0)
    p.add_argument("--ready-file", help="created when the first content event arrives")
    p.add_argument("--armed-file", help="created once the client library is loaded, before --go-file is awaited")
    p.add_argument("--go-file", help="the request is sent only once this file exists")
    a = p.parse_args()
    if a.go_file:
        # Load the library first: every client of a cell then sends within milliseconds of the
        # others, and no stream can end before the slowest interpreter has started.
        __import__({"openai": "openai", "httpx": "httpx", "requests": "requests"}.get(a.client, "http.client"))
        open(a.armed_file, "a").close()
        waited = time.monotonic()
        while not os.path.exists(a.go_file):
            if time.monotonic() - waited > 120:
                sys.exit("no go file within 120 s")
            time.sleep(0.01)
    t = time.monotonic()
    try:
        res = RUN[a.client](a, a.max_tokens)
    except Exception as e:  # refused, reset, a gateway's 504, a dead server: what the client saw
        res = Seen(a.max_tokens).d
        res["error"] = type(e).__name__
        res["status"] = getattr(e, "status_code", None)
        res["context_exceeded"] = context_exceeded(e)
    for d in res if isinstance(res, list) else [res]:
        d["client"] = a.client
        d["secs"] = round(time.monotonic() - t, 3)
        print(json.dumps(d), flush=True)


if __name__ == "__main__":
    sys.exit(main())
