"""llama-cpp-python's OpenAI server (as `python -m llama_cpp.server` builds it) with probe's test
plugin around it. Usage: llama_cpp_server.py MODEL PORT"""
import os
import sys

import uvicorn
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_plugin import ProbeTestMiddleware  # noqa: E402

model, port = sys.argv[1], int(sys.argv[2])
app = create_app(
    server_settings=ServerSettings(host="127.0.0.1", port=port),
    model_settings=[ModelSettings(model=model, n_ctx=2048, n_threads=2, verbose=False)],
)
app.add_middleware(ProbeTestMiddleware)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
