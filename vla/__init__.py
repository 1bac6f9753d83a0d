"""VLA side: compact and token VLA policies, action tokenizer, the episode runner and its
collectors, behaviour cloning and held-out evaluation on the MuJoCo suite (``perceptrl.sim``).

Submodules are imported where used (``perceptrl.vla.compact`` ...), so reading the recipe's
``vla.config`` sections does not load torch."""
