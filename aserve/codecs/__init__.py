"""Wire formats to and from numpy arrays: V2 JSON, the binary tensor extension."""
