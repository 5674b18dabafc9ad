"""The engine: dies, compiled-graph registry, runner, sampler, scheduler, sessions."""
