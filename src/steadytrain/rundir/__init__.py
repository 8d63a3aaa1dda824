"""The run directory: its layout and the rule that one is never overwritten (:mod:`.layout`), and the
shape of each file in it (:mod:`.schema`). Read by ``train`` (which writes runs) and ``runs`` (which reads them)."""
