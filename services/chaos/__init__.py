"""`specd bench chaos`: the real services under a seeded schedule of faults, and a checker of
what must survive them (issue 22). `services.chaos.run` is the command and its design;
`load` the clients, `faults` the schedule and injectors, `records` what is recorded, `check`
the properties, as pure functions over the records."""
