"""Token channels from executor threads to the loop, and their HTTP/gRPC adapters.

Empty until generative models land: unary inference does not stream.
"""
