"""Token streaming: bounded per-request channels filled on the loop from the
engine's steps (channel.py), and the HTTP framings: server-sent events
(sse.py) and newline-delimited JSON (ndjson.py), one chosen per request by
its Accept header (http_stream.py).
The gRPC stream adapters live with the gRPC frontend (frontends/grpc_generate.py).
"""
