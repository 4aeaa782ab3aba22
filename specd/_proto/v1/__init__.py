"""Generated gRPC stubs of specd.v1 (see proto/generate.py)."""
