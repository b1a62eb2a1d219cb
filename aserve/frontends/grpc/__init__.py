"""The grpc.aio frontend (frontends layer, on the loop): server.py, and the
services it serves (kserve.py, generate.py, health.py)."""
