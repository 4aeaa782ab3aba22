"""Generated wire stubs (gRPC); the rest of specd never imports grpc."""
