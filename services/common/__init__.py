"""What every specd service shares: configuration, the gRPC server and channels (auth, TLS, health,
reflection, tracing, drain), telemetry, tensor transport and checkpoint transfer.

Import the submodule you need (``services.common.server``, ``services.common.wire``, ...): this
package imports nothing itself, so a module that needs only the config does not pay for torch.
"""
