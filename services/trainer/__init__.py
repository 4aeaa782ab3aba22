"""The SpecOPD trainer service: distils the drafter from the live trace stream and publishes
versions that pass the held-out gate (see `services.trainer.server`)."""
