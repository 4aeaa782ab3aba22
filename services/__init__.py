"""specd services: thin gRPC servers over the library (drafter, verifier, trainer) and what they share."""
