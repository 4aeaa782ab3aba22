"""Capacity planning: a discrete-event simulator of the serving pipeline (`specd.plan.sim`) and
the replica-ratio / block-length planner behind ``specd plan`` (`specd.plan.planner`)."""
