"""Building a run from its config, before any step: the config itself, the batch plan, data, model, optimizer,
schedule and accumulator, the speed settings, and the process group (DDP or FSDP2)."""
