"""Training: target pre-training (zoo), drafter training, SpecOPD."""
