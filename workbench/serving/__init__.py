"""Live serving: launch or attach a server (SGLang or the local engine) and talk to it.

`process` runs any HTTP server as a torn-down-on-exit process group; `sglang` turns a typed
serve spec into SGLang's exact argv and environment and reads its metrics.
"""
