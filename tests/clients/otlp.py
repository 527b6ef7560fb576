#!/usr/bin/env python3
"""OTLP reader for tests/fit.rs, made of the OpenTelemetry project's own message definitions
(the `opentelemetry-proto` package), not of probe's code.

  otlp.py receive --port-file F --out F [--port N]
                                          OTLP/HTTP receiver: decodes each POST /v1/traces and
                                          /v1/logs (gzip or not) as a protobuf
                                          ExportTraceServiceRequest / ExportLogsServiceRequest and
                                          appends it, as OTLP/JSON with its contentEncoding, one a
                                          line, to --out; answers 200.
  otlp.py parse FILE                      parses an OTLP/JSON file strictly (unknown fields are
                                          errors) and prints it back as OTLP/JSON.
"""
import argparse
import gzip
import http.server
import json
import sys

from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def as_json(msg):
    return json.dumps(json_format.MessageToDict(msg))


def receive(port_file, out, port):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                kinds = {"/v1/traces": ExportTraceServiceRequest, "/v1/logs": ExportLogsServiceRequest}
                if self.path not in kinds or self.headers.get("Content-Type") != "application/x-protobuf":
                    raise ValueError(f"unexpected {self.path} {self.headers.get('Content-Type')}")
                encoding = self.headers.get("Content-Encoding", "identity")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding != "identity":
                    raise ValueError(f"unexpected Content-Encoding {encoding}")
                req = kinds[self.path].FromString(body)
                d = json_format.MessageToDict(req)
                d["contentEncoding"] = encoding
                line = json.dumps(d)
                status = 200
            except Exception as e:  # noqa: BLE001 - the test reads the error line
                line = json.dumps({"error": repr(e)})
                status = 400
            with open(out, "a") as f:
                f.write(line + "\n")
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", port), Handler)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    import os

    os.rename(port_file + ".tmp", port_file)
    srv.serve_forever()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("receive")
    r.add_argument("--port-file", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--port", type=int, default=0)
    p = sub.add_parser("parse")
    p.add_argument("file")
    a = ap.parse_args()
    if a.cmd == "receive":
        receive(a.port_file, a.out, a.port)
    else:
        with open(a.file) as f:
            req = json_format.Parse(f.read(), ExportTraceServiceRequest())
        sys.stdout.write(as_json(req) + "\n")


if __name__ == "__main__":
    main()
