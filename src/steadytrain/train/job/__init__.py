"""The running job: :class:`~steadytrain.train.job.core.Job`, the loop, its state, validation, spikes, stopping,
restoring (resume and rollback) and the files a run writes besides checkpoints."""
