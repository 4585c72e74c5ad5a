"""The estimate pipeline in three steps (ARCHITECTURE.md): resolve (config after "auto", strategy, stack,
runtime constants, calibration passed in) -> step (the analytic or traced front end, one StepMemory record)
-> verdict (allocator replay, band, roofline, cost). `planner.estimate.estimate` runs them.
"""
