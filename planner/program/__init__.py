"""The step program of one training step: the tracer (`trace`) and the CPU → CUDA mappings (`cuda`)."""
