"""The engine: continuous batching over a paged KV cache (step scheduler, block manager, attention, model
runner, sampler), and the torch-free interface the worker drives it through."""
