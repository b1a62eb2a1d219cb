"""Token streaming: bounded per-request channels filled on the loop from the
engine's steps (channel.py), and the server-sent-events framing (sse.py).
The gRPC stream adapters live with the gRPC frontend (frontends/grpc_generate.py).
"""
