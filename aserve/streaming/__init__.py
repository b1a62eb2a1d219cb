"""Token streaming: bounded per-request channels filled on the loop from the
engine's steps (channel.py). The HTTP framings (server-sent events, NDJSON)
live with the HTTP frontend (frontends/http/stream.py), the gRPC stream
adapters with the gRPC frontend (frontends/grpc/generate.py).
"""
