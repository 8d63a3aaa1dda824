"""steadytrain's run directory from other frameworks' training loops.

:mod:`steadytrain.integrations.hf`: a Hugging Face ``Trainer`` callback (``SteadytrainCallback``) and its optional
companion (``SteadytrainLossMixin``), which write the run directory every steadytrain command reads while the
``Trainer`` runs its own backward and optimizer step. Each integration imports its framework only when used.
"""
