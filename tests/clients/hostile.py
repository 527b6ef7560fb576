"""Listeners and clients a node agent meets in a neighbouring pod (tests/neighbours.rs).

    hostile.py listen MODE PORT LOG   a TCP server on 127.0.0.1:PORT; every request head it
                                      reads is appended to LOG (one JSON line each), then:
        log      404 at once (a plain web server that notes your headers)
        api401   401 with an API's JSON error body, to everything
        trickle  a 200 head, one byte a second, never ending
        endless  a 200 with a chunked body that never ends, as fast as it is read
        silent   nothing, ever
    hostile.py slowloris HOST:PORT    one byte of a request head every 1.5 s, forever

Each connection has a thread of its own, so one slow answer holds back nothing of the listener's.
"""
import json
import socket
import sys
import threading
import time


def read_head(conn):
    data = b""
    conn.settimeout(5)
    try:
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def serve(mode, conn, log, lock):
    try:
        head = read_head(conn)
        with lock, open(log, "a") as f:
            f.write(json.dumps({"mode": mode, "head": head.decode("latin-1")}) + "\n")
        if mode == "log":
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        elif mode == "api401":
            body = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'
            conn.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        elif mode == "trickle":
            for b in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: " + b"a" * 100000:
                conn.sendall(bytes([b]))
                time.sleep(1)
        elif mode == "endless":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            conn.sendall(b'9\r\n{"data":[\r\n')
            chunk = b"%x\r\n%s\r\n" % (65536, b'"' + b"x" * 65534 + b'"')
            while True:
                conn.sendall(chunk)
        elif mode == "silent":
            time.sleep(3600)
    except OSError:
        pass
    finally:
        conn.close()


def listen(mode, port, log):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    print("listening", flush=True)
    lock = threading.Lock()
    while True:
        conn, _ = s.accept()
        threading.Thread(target=serve, args=(mode, conn, log, lock), daemon=True).start()


def slowloris(addr):
    host, port = addr.rsplit(":", 1)
    c = socket.create_connection((host, int(port)))
    print("connected", flush=True)
    for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 100000:
        try:
            c.sendall(bytes([b]))
        except OSError:
            # Cut off: come back, as an attacker would (and stop once nobody listens).
            try:
                c = socket.create_connection((host, int(port)))
            except OSError:
                return
        time.sleep(1.5)


if __name__ == "__main__":
    if sys.argv[1] == "listen":
        listen(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        slowloris(sys.argv[2])
