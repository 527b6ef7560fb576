#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/<target>/ from real message shapes: the golden
conversations in tests/data/stream (Ollama, vLLM, llama.cpp through a gateway), llama.cpp and
OpenAI streams with a long final chunk, chunked bodies, SSE and NDJSON bodies, and small real
recordings. The binary layouts are the ones the fuzz targets read (see each target's doc).

    python3 fuzz/seeds.py [PROBE_BIN]     # PROBE_BIN: target/release/probe, for `probe synth`
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
DATA_CAP = 4095
TICK_NS = 100_000


def u16(n):
    return struct.pack("<H", n)


def u32(n):
    return struct.pack("<I", n)


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


class Stream:
    """Operations of the stream_tracker target, written the way the kernel records them."""

    SYSCALLS = ["read", "write", "recvfrom", "sendto", "readv", "writev", "recvmsg", "sendmsg"]

    def __init__(self, keep_text=False):
        self.out = bytearray(u32(1000) + bytes([1 if keep_text else 0]))
        self.t_ms = 0.0

    def step(self, t_ms):
        s = max(0, min(65535, round((t_ms - self.t_ms) * 1e6 / TICK_NS)))
        self.t_ms = t_ms
        return s

    def data(self, t_ms, send, data, sock=0, capture=None, vectored=False):
        """One call that moved `data`; a single-buffer call over DATA_CAP also sends its tail."""
        step = self.step(t_ms)
        if capture is not None or vectored:
            sc = "writev" if send else "readv"
            cap = len(data) if capture is None else min(capture, len(data))
        else:
            sc = "write" if send else "read"
            cap = min(len(data), DATA_CAP)
        uncaptured = len(data) - cap
        flags = (1 if send else 0) | (self.SYSCALLS.index(sc) << 1)
        extra = b""
        if uncaptured:
            flags |= (2 << 6)
            extra = u32(uncaptured)
        self.out += bytes([sock & 3, flags]) + u16(step) + extra + u16(cap) + data[:cap]
        tail = min(uncaptured, DATA_CAP) if sc in ("read", "write") and cap == DATA_CAP else 0
        if tail:
            self.out += bytes([(4 << 2) | (sock & 3)]) + u16(0) + bytes([0]) + u16(tail) + data[-tail:]

    def sock(self, t_ms, what, old=0, new=0, sock=0):
        w = {"state": 0, "reset_received": 1, "reset_sent": 2}[what]
        self.out += bytes([(5 << 2) | (sock & 3), w, old, new]) + u16(self.step(t_ms))

    def peer_fin(self, t_ms, sock=0):
        self.sock(t_ms, "state", 1, 8, sock)  # ESTABLISHED -> CLOSE_WAIT

    def close(self, t_ms, sock=0):
        self.sock(t_ms, "state", 9, 7, sock)  # LAST_ACK -> CLOSE

    def take(self):
        self.out += bytes([6 << 2])


def chunk(b):
    return b"%x\r\n" % len(b) + b + b"\r\n"


def req(path, body, extra=b""):
    return b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path, extra, len(body), body)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
NDJSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"


def sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def openai_delta(text, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]}


def llama_final(prompt_len):
    return {"content": "", "stop": True, "stop_type": "limit", "truncated": False, "prompt": "x" * prompt_len,
            "timings": {"prompt_n": prompt_len // 4, "prompt_ms": 20.5, "predicted_n": 16, "predicted_ms": 120.0}}


def stream_seeds():
    # The golden conversations of probe-user/tests/streams.rs.
    base = os.path.join(ROOT, "tests", "data", "stream")
    for name in sorted(os.listdir(base)):
        st = Stream()
        for seg in json.load(open(os.path.join(base, name, "conversation.json"))):
            if "sock" in seg:
                {"peer_reset": lambda t: st.sock(t, "reset_received"),
                 "peer_fin": st.peer_fin, "close": st.close}[seg["sock"]](seg["t_ms"])
                continue
            st.data(seg["t_ms"], seg["dir"] == "send", seg["data"].encode(), capture=seg.get("capture"))
        write("stream_tracker", "golden-" + name, bytes(st.out))

    # llama.cpp /completion streamed, its final chunk echoing a long prompt (head + tail records).
    st = Stream()
    st.data(0, False, req(b"/completion", b'{"prompt":"The lighthouse keeper","n_predict":16,"stream":true}'))
    st.data(5, True, SSE_HEAD)
    for i, w in enumerate([b"The", b" light"]):
        st.data(30 + i * 8, True, chunk(sse({"content": w.decode(), "stop": False})))
    st.data(60, True, chunk(sse(llama_final(9000))))
    st.data(61, True, b"0\r\n\r\n")
    st.peer_fin(70)
    st.close(71)
    write("stream_tracker", "llama-completion-long-final", bytes(st.out))

    # OpenAI chat through keep-alive: two requests, the second non-streamed (Content-Length).
    st = Stream()
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}'
    st.data(0, False, req(b"/v1/chat/completions", body))
    st.data(4, True, SSE_HEAD)
    st.data(9, True, chunk(sse(openai_delta("Hel"))))
    st.data(17, True, chunk(sse(openai_delta("lo", "length"))))
    st.data(18, True, chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    st.take()
    body = b'{"model":"m","messages":[{"role":"user","content":"again"}],"max_completion_tokens":8}'
    st.data(30, False, req(b"/v1/chat/completions?api_key=secret", body, b"Authorization: Bearer sk-1\r\n"))
    answer = json.dumps({"choices": [{"message": {"content": "hello"}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()
    st.data(50, True, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
    st.peer_fin(60)
    st.close(61)
    write("stream_tracker", "openai-keepalive", bytes(st.out))

    # Two concurrent clients, one resets mid-stream; a request sent in two writes with a 100 Continue.
    st = Stream()
    st.data(0, False, req(b"/v1/chat/completions", body), sock=0)
    st.data(1, False, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 30\r\n\r\n", sock=1)
    st.data(2, True, b"HTTP/1.1 100 Continue\r\n\r\n", sock=1)
    st.data(3, False, b'{"prompt":"a","max_tokens":2} ', sock=1)
    st.data(5, True, SSE_HEAD, sock=0)
    st.data(6, True, SSE_HEAD, sock=1)
    st.data(9, True, chunk(sse(openai_delta("a"))), sock=0)
    st.data(10, True, chunk(sse({"choices": [{"text": "b", "finish_reason": None}]})), sock=1)
    st.sock(12, "reset_received", sock=0)
    st.close(12, sock=0)
    st.data(14, True, chunk(sse({"choices": [{"text": "", "finish_reason": "stop"}]})) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n", sock=1)
    write("stream_tracker", "two-clients-one-reset", bytes(st.out))

    # Ollama's front as a client of its runner (the target sends the request), NDJSON response.
    st = Stream()
    st.data(0, True, req(b"/api/chat", b'{"model":"llama3.2","messages":[{"role":"user","content":"hi"}],"options":{"num_predict":3}}'))
    st.data(40, False, NDJSON_HEAD)
    st.data(50, False, chunk(b'{"message":{"role":"assistant","content":"Hi"},"done":false}\n'))
    st.data(60, False, chunk(b'{"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop","eval_count":1}\n') + b"0\r\n\r\n")
    write("stream_tracker", "ollama-client-side", bytes(st.out))

    # Attached mid-response: the first bytes are chunks of an SSE stream; then an error event.
    st = Stream()
    st.data(0, True, chunk(sse(openai_delta("x"))))
    st.data(5, True, chunk(b'event: error\ndata: {"code":500,"message":"context size exceeded","type":"server_error"}\n\n') + b"0\r\n\r\n")
    st.close(6)
    write("stream_tracker", "attached-mid-response-error", bytes(st.out))

    # A vectored write cut by the capture limit (no tail), then a response without a length.
    st = Stream()
    st.data(0, False, req(b"/v1/chat/completions", b'{"messages":[{"role":"user","content":"' + b"y" * 5000 + b'"}],"max_tokens":5}'))
    st.data(3, True, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n", vectored=True)
    st.data(9, True, sse(openai_delta("z" * 6000, "stop")), capture=DATA_CAP)
    st.sock(10, "state", 1, 4)  # ESTABLISHED -> FIN_WAIT1: the server closes
    st.close(11)
    write("stream_tracker", "until-close-cut-write", bytes(st.out))


def http_seeds():
    heads = {
        "req-chat": req(b"/v1/chat/completions", b'{"stream":true}', b"Authorization: Bearer sk-abc\r\nCookie: s=1\r\n"),
        "req-query-key": b"GET /v1/models?api_key=abc&x=1 HTTP/1.1\r\nHost: x\r\nX-Api-Key: k\r\n\r\n",
        "req-chunked": b"POST /completion HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        "resp-sse": SSE_HEAD,
        "resp-json": b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 2\r\n\r\n{}",
        "resp-100": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    }
    for name, h in heads.items():
        write("http_body", "heads-" + name, bytes([2]) + h)
    # Bodies in pieces: chunked SSE, with a gap inside a chunk; a Content-Length JSON body.
    wire = chunk(sse(openai_delta("Hello"))) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    pieces = bytearray([0, 2])
    for i in range(0, len(wire), 23):
        p = wire[i:i + 23]
        pieces += bytes([len(p)]) + p
    write("http_body", "body-chunked-sse", bytes(pieces))
    body = chunk(b"x" * 40)
    write("http_body", "body-chunked-gap", bytes([0, 2, 13]) + body[:13] + bytes([0xf0]) + u16(20) + bytes([len(body) - 33]) + body[33:] + bytes([5]) + b"0\r\n\r\n")
    j = b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}'
    write("http_body", "body-length", bytes([0, 1]) + u32(len(j)) + bytes([30]) + j[:30] + bytes([0xf1]) + u16(4) + bytes([len(j) - 34]) + j[34:])
    write("http_body", "body-until-close", bytes([0, 3, 20]) + b"data: {\"a\":1}\n\nabcd" + bytes([0xf2]) + u16(999))
    # Chunked round trip: three chunks, cuts, a gap in the second.
    rt = bytearray([1, 3])
    for c in [b"hello", b"0123456789abcdef", b"\r\n0\r\n"]:
        rt += u16(len(c)) + c
    rt += bytes([8 | 16 | 2, 3]) + u16(4) + u16(17) + u16(40) + bytes([1]) + u16(3) + u16(12)
    write("http_body", "chunked-roundtrip", bytes(rt))


def splitter_seeds():
    bodies = {
        "sse-openai": (0, b"".join(sse(openai_delta(w)) for w in ["a", "b"]) + sse(openai_delta(None, "stop")) + b"data: [DONE]\n\n"),
        "sse-llama": (0, sse({"content": "x", "stop": False}) + sse(llama_final(200))),
        "sse-crlf-error": (0, b"event: error\r\ndata: {\"code\":400,\"type\":\"invalid_request_error\",\"message\":\"the request exceeds the available context size\"}\r\n\r\nerror: {\"code\":500}\r\n\r\n"),
        "ndjson-ollama": (1, b'{"response":"The","done":false}\n{"response":"","done":true,"done_reason":"length","total_duration":4120,"eval_count":3}\n'),
        "json-openai": (2, b'{"choices":[{"message":{"content":"hi","tool_calls":[]},"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":16}}'),
        "json-error": (2, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'),
        # llama.cpp's refusal of a prompt over the slot's context: the sizes it quotes are kept as numbers.
        "json-context-error": (2, b'{"error":{"code":400,"message":"request (3032 tokens) exceeds the available context size (1024 tokens)","type":"exceed_context_size_error","n_prompt_tokens":3032,"n_ctx":1024}}'),
    }
    for name, (kind, body) in bodies.items():
        # Splitting (cuts every 7 bytes or so, holes before pieces 2 and 4), keep text off.
        cuts = [len(body) * i // 5 for i in range(1, 5)]
        write("splitter", "split-" + name, bytes([kind << 1, len(cuts)]) + b"".join(u16(c) for c in cuts) + u16(0b10100) + body)
        # Fragments: the body cut at its start (what salvage reads after a hole).
        write("splitter", "frag-" + name, bytes([1]) + body[len(body) // 3:])
    write("splitter", "frag-request", bytes([1]) + b'{"model":"m","prompt":"\\"stream\\": false","max_tokens":-1,"stream":true,"options":{"num_predict":64}}')


def python_seeds():
    """python_frames: a layout byte, code / instruction / runtime addresses (u32 offsets into the
    image, mapped at 0x10000), a native frame count, then an image holding a code object (names,
    first line, a location table of every entry form) and an interpreter with two threads, laid
    out as CPython 3.11 and 3.12 lay them out (record/python.rs `layout`)."""
    base = 0x10000

    def image(ascii_size, fl, threads_head, native):
        im = bytearray(0x1000)

        def q(off, v):
            im[off:off + 8] = struct.pack("<Q", v)

        def text(off, t):
            q(off + 16, len(t))
            im[off + 32:off + 36] = struct.pack("<I", (1 << 5) | (1 << 6) | (1 << 2))
            im[off + ascii_size:off + ascii_size + len(t)] = t.encode()

        code = 0x100
        q(code + 112, base + 0x500)
        q(code + 120, base + 0x480)
        q(code + 128, base + 0x400)
        im[code + fl:code + fl + 4] = struct.pack("<i", 10)
        q(code + 136, base + 0x600)
        text(0x400, "Server.handle")
        text(0x480, "handle")
        text(0x500, "/srv/lib/python3.11/site-packages/app/server.py")
        table = bytes([0x80 | (13 << 3) | 1, 2, 0x80 | (11 << 3), 4, 9, 0x80 | (14 << 3) | 2, 5, 0, 1, 1, 0x80 | (15 << 3), 0x80 | (3 << 3), 7])
        q(0x600 + 16, len(table))
        im[0x600 + 32:0x600 + 32 + len(table)] = table
        q(0x800 + 40, base + 0x900)
        q(0x900 + threads_head, base + 0xA00)
        q(0xA00 + native, 1234)
        q(0xA00 + 8, base + 0xB00)
        q(0xB00 + native, 1235)
        return bytes(im)

    def head(which, instr):
        return bytes([which]) + u32(0x100) + u32(0x100 + instr) + u32(0x800) + bytes([8])

    write("python_frames", "seed-311", head(1, 184 + 4) + image(48, 72, 16, 160))
    write("python_frames", "seed-312", head(0, 192 + 2) + image(40, 68, 72, 144))


def recording_seeds(probe):
    d = os.path.join(CORPUS, "recording_report")
    os.makedirs(d, exist_ok=True)
    if probe and os.path.exists(probe):
        for n in (20, 200, 1000):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rec")
                subprocess.run([probe, "synth", "--events", str(n), "--out", out], check=True, stdout=subprocess.DEVNULL)
                shutil.copy(os.path.join(out, "events.bin"), os.path.join(d, "synth-%d" % n))
    else:
        print("seeds: no probe binary: recording seeds from tests/data only", file=sys.stderr)
    demo = open(os.path.join(ROOT, "tests", "data", "report", "demo", "events.bin"), "rb").read()
    write("recording_report", "demo", demo)
    write("recording_report", "demo-torn", demo[:20000])


if __name__ == "__main__":
    for t in ("stream_tracker", "http_body", "splitter", "python_frames"):
        shutil.rmtree(os.path.join(CORPUS, t), ignore_errors=True)
    stream_seeds()
    http_seeds()
    splitter_seeds()
    python_seeds()
    recording_seeds(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "release", "probe"))
