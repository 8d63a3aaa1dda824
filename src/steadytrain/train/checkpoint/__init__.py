"""Checkpoints on disk: which a run has and loading one (:mod:`.catalog`), the files of one (:mod:`.files`),
the shape of its ``state.json`` (:mod:`.schema`), and writing them (:mod:`.writer`). Restoring one into a
running job is :mod:`steadytrain.train.job.restore`."""
