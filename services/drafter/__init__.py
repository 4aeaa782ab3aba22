"""The D3D drafter service: `specd.drafters.d3d.D3DDrafter` behind gRPC (proto/specd/v1/drafter.proto).

``python -m services.drafter --model DIR`` serves one drafter replica; `server` holds the servicer
and ``main``, `weights` the watcher that swaps in new weight versions published by the trainer.
The verifier's client side (many replicas, failover) is `services.verifier.drafter_pool`.
"""
