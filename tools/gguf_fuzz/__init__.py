"""A fuzz harness for model files: seeded mutations of GGUF fixtures, run through the commands users run.

``layout`` maps a GGUF's header to its fields' byte spans (with gguf-py's
reader, an implementation independent of ours); ``mutate`` derives a mutant
from a fixture and a seed; ``cases`` runs ``plan``, ``doctor --verify``,
``logits`` and ``Engine.open`` on one mutant and sorts each outcome;
``campaign`` drives worker processes with a per-case timeout and a memory
watch. ``tools/fuzz_gguf.py`` is the long run (with a receipt);
``tests/test_fuzz_gguf.py`` the short one in the suite.
"""
